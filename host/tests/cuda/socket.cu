// Sockets from CUDA C++ through gdaki's C ABI (gdaki_device.h): block b of one launch plays
// roles[b] on socks[b]. Echo servers (a block each, GPUnet's model), a warp client and a
// one-thread client that check what comes back, and the refusals. The test (cuda_cpp.rs) pairs
// the sockets: some servers answer CPU clients, the clients talk to servers in this launch.
#include "gdaki_layout_check.h"
#include "gdaki_test_check.h"

#define ROLE_ECHO 0
#define ROLE_WARP_CLIENT 1
#define ROLE_THREAD_CLIENT 2
#define ROLE_ECHO_IN_PLACE 3

// Byte i of a client's stream.
__device__ static uint8_t pattern(uint64_t i) { return (uint8_t)(i * 131 + 7); }

// The echo server, in block scope: receive what is there, send it all back, until the
// client's end of stream; then close (shut down, wait for the end, flush).
__device__ static void echo(gdaki_dev_socket *s, uint8_t *buf, uint64_t buf_len, uint32_t *status,
                            uint64_t *echoed) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t total = 0;
  for (;;) {
    uint64_t n = 0;
    GDAKI_TEST_CHECK(gdaki_socket_recv_block_cta(s, &scratch, buf, buf_len, &n), GDAKI_OK);
    if (n == 0) break;
    GDAKI_TEST_CHECK(gdaki_socket_send_all_block_cta(s, &scratch, buf, n), GDAKI_OK);
    total += n;
  }
  GDAKI_TEST_CHECK(gdaki_socket_close_block_cta(s, &scratch), GDAKI_OK);
  if (threadIdx.x == 0) echoed[blockIdx.x] = total;
  status[t] = GDAKI_OK;
}

// The echo server reading in place: each peek shows where the next bytes landed in the receive
// ring, the block sends them back from there and only then consumes them (the peer may write
// there again once they are credited). A count past what landed is refused, nothing consumed.
__device__ static void echo_in_place(gdaki_dev_socket *s, uint32_t *status, uint64_t *echoed) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t total = 0;
  for (;;) {
    uint64_t addr = 0, n = 0;
    // No bound of its own: the view ends where the frame does.
    GDAKI_TEST_CHECK(gdaki_socket_peek_block_cta(s, &scratch, ~0ull, &addr, &n), GDAKI_OK);
    if (n == 0) break;
    GDAKI_TEST_CHECK(gdaki_socket_consume_block_cta(s, &scratch, n + 1), GDAKI_CODE_BAD_ARGUMENT);
    GDAKI_TEST_CHECK(gdaki_socket_send_all_block_cta(s, &scratch, (const void *)addr, n), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_consume_block_cta(s, &scratch, n), GDAKI_OK);
    total += n;
  }
  GDAKI_TEST_CHECK(gdaki_socket_close_block_cta(s, &scratch), GDAKI_OK);
  if (threadIdx.x == 0) echoed[blockIdx.x] = total;
  status[t] = GDAKI_OK;
}

// A warp sends `rounds` messages of `len` bytes (partial sends allowed), reads each back whole
// and compares (odd rounds read it in place: peek, copy out, consume), then closes.
__device__ static void warp_client(gdaki_dev_socket *s, uint8_t *buf, uint64_t len, uint32_t rounds,
                                   uint32_t *status, uint64_t *echoed) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x >= 32) {
    status[t] = GDAKI_OK;
    return;
  }
  // Nothing was sent yet: nothing can come back.
  uint64_t n = 1;
  GDAKI_TEST_CHECK(gdaki_socket_try_recv_warp_cta(s, buf, len, &n), GDAKI_CODE_WOULD_BLOCK);
  uint64_t landed = 0;
  GDAKI_TEST_CHECK(gdaki_socket_try_peek_warp_cta(s, len, &landed, &n), GDAKI_CODE_WOULD_BLOCK);
  for (uint32_t r = 0; r < rounds; r++) {
    for (uint64_t i = threadIdx.x; i < len; i += 32) buf[i] = pattern(r * len + i);
    __syncwarp();
    uint64_t at = 0;
    while (at < len) {
      uint64_t sent = 0;
      GDAKI_TEST_CHECK(gdaki_socket_send_warp_cta(s, buf + at, len - at, &sent), GDAKI_OK);
      at += sent;
    }
    for (uint64_t i = threadIdx.x; i < len; i += 32) buf[i] = 0;
    __syncwarp();
    if (r % 2 == 0) {
      GDAKI_TEST_CHECK(gdaki_socket_recv_exact_warp_cta(s, buf, len), GDAKI_OK);
    } else {
      for (uint64_t got = 0; got < len;) {
        uint64_t k = 0;
        GDAKI_TEST_CHECK(gdaki_socket_peek_warp_cta(s, len - got, &landed, &k), GDAKI_OK);
        GDAKI_TEST_CHECK(k != 0 ? GDAKI_OK : 4000u, GDAKI_OK);
        const uint8_t *from = (const uint8_t *)landed;
        for (uint64_t i = threadIdx.x; i < k; i += 32) buf[got + i] = from[i];
        __syncwarp();
        GDAKI_TEST_CHECK(gdaki_socket_consume_warp_cta(s, k), GDAKI_OK);
        got += k;
      }
    }
    for (uint64_t i = threadIdx.x; i < len; i += 32) {
      if (buf[i] != pattern(r * len + i)) {
        status[t] = (__LINE__ << 16) | 0xdada;
        return;
      }
    }
  }
  GDAKI_TEST_CHECK(gdaki_socket_close_warp_cta(s), GDAKI_OK);
  // After the close: sends are refused, receives say the stream ended.
  GDAKI_TEST_CHECK(gdaki_socket_send_warp_cta(s, buf, 1, 0), GDAKI_CODE_CLOSED);
  GDAKI_TEST_CHECK(gdaki_socket_recv_warp_cta(s, buf, len, &n), GDAKI_OK);
  GDAKI_TEST_CHECK(n == 0 ? GDAKI_OK : 1000u + (uint32_t)n, GDAKI_OK);
  if (threadIdx.x == 0) echoed[blockIdx.x] = (uint64_t)len * rounds;
  status[t] = GDAKI_OK;
}

// One thread: a short message and its echo, the refusals, then a close.
__device__ static void thread_client(gdaki_dev_socket *s, uint8_t *buf, uint32_t *status, uint64_t *echoed) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  if (threadIdx.x != 0) {
    status[t] = GDAKI_OK;
    return;
  }
  const char msg[] = "c++ socket";
  uint64_t n = 0;
  GDAKI_TEST_CHECK(gdaki_socket_send_thread_exclusive(s, msg, sizeof msg, &n), GDAKI_OK);
  GDAKI_TEST_CHECK(n == sizeof msg ? GDAKI_OK : 1000u + (uint32_t)n, GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_socket_recv_exact_thread_exclusive(s, buf, sizeof msg), GDAKI_OK);
  for (unsigned i = 0; i < sizeof msg; i++) {
    GDAKI_TEST_CHECK(buf[i] == (uint8_t)msg[i] ? GDAKI_OK : 2000u + i, GDAKI_OK);
  }
  // Refusals: no handle, a handle of another layout, a buffer without bytes.
  gdaki_dev_socket stale = *s;
  stale.version += 1;
  GDAKI_TEST_CHECK(gdaki_socket_send_thread_exclusive(0, msg, 1, 0), GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_socket_send_thread_exclusive(&stale, msg, 1, 0), GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_socket_recv_thread_exclusive(s, 0, 8, 0), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(gdaki_socket_send_thread_exclusive(s, 0, 0, &n), GDAKI_OK);
  GDAKI_TEST_CHECK(n == 0 ? GDAKI_OK : 3000u, GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_socket_flush_thread_exclusive(s), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_socket_close_thread_exclusive(s), GDAKI_OK);
  echoed[blockIdx.x] = sizeof msg;
  status[t] = GDAKI_OK;
}

extern "C" __global__ void cpp_sockets(gdaki_dev_socket **socks, const uint32_t *roles, uint8_t *bufs,
                                       uint64_t buf_len, uint64_t msg_len, uint32_t rounds, uint32_t *status,
                                       uint64_t *echoed) {
  gdaki_dev_socket *s = socks[blockIdx.x];
  uint8_t *buf = bufs + buf_len * blockIdx.x;
  switch (roles[blockIdx.x]) {
    case ROLE_ECHO:
      echo(s, buf, buf_len, status, echoed);
      break;
    case ROLE_ECHO_IN_PLACE:
      echo_in_place(s, status, echoed);
      break;
    case ROLE_WARP_CLIENT:
      warp_client(s, buf, msg_len, rounds, status, echoed);
      break;
    default:
      thread_client(s, buf, status, echoed);
      break;
  }
}

// Writes "127.0.0.1:<port>" and its NUL into `addr` (32 bytes).
__device__ static void local_addr(char *addr, uint32_t port) {
  const char prefix[] = "127.0.0.1:";
  unsigned at = 0;
  for (; prefix[at] != 0; at++) addr[at] = prefix[at];
  char digits[8];
  unsigned n = 0;
  do {
    digits[n++] = (char)('0' + port % 10);
    port /= 10;
  } while (port != 0);
  while (n > 0) addr[at++] = digits[--n];
  addr[at] = 0;
}

// Connection set-up from the kernel through a socket service (GPUnet's gbind, gaccept and
// gconnect_in): block 0 listens and accepts, block 1 connects to it (it learns the port
// through `port_word`), both in block scope; block 1 sends `len` bytes, block 0 echoes them,
// block 1 checks them; both close and release, block 0 stops listening. Block 2 checks the
// refusals in thread and warp scope (`closed_port`: a port nothing listens at).
extern "C" __global__ void cpp_socket_service(const gdaki_dev_socket_service *svc, uint32_t *status,
                                              volatile uint32_t *port_word, uint8_t *bufs, uint64_t len,
                                              uint32_t closed_port) {
  __shared__ gdaki_block_scratch scratch;
  __shared__ char addr[32];
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  uint8_t *buf = bufs + blockIdx.x * 2 * len;
  gdaki_dev_socket *s = 0;
  if (blockIdx.x == 0) {
    uint32_t port = 0;
    GDAKI_TEST_CHECK(gdaki_socket_listen_block(svc, &scratch, 0, &port), GDAKI_OK);
    if (threadIdx.x == 0) {
      *port_word = port;
      __threadfence_system();
    }
    GDAKI_TEST_CHECK(gdaki_socket_accept_block(svc, &scratch, port, &s), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_recv_exact_block_gpu(s, &scratch, buf, len), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_send_all_block_gpu(s, &scratch, buf, len), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_close_block_gpu(s, &scratch), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_release_block(svc, &scratch, s), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_unlisten_block(svc, &scratch, port), GDAKI_OK);
  } else if (blockIdx.x == 1) {
    if (threadIdx.x == 0) {
      uint32_t port = 0;
      for (uint64_t spins = 0; port == 0 && spins < (1ull << 32); spins++) port = *port_word;
      local_addr(addr, port);
    }
    __syncthreads();
    GDAKI_TEST_CHECK(gdaki_socket_connect_block(svc, &scratch, addr, &s), GDAKI_OK);
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) buf[i] = pattern(i);
    __syncthreads();
    GDAKI_TEST_CHECK(gdaki_socket_send_all_block_gpu(s, &scratch, buf, len), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_recv_exact_block_gpu(s, &scratch, buf + len, len), GDAKI_OK);
    // Checked after the block's last collective call (a thread that left early would leave the
    // others waiting in it).
    bool same = true;
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) same &= buf[len + i] == pattern(i);
    GDAKI_TEST_CHECK(gdaki_socket_close_block_gpu(s, &scratch), GDAKI_OK);
    GDAKI_TEST_CHECK(gdaki_socket_release_block(svc, &scratch, s), GDAKI_OK);
    GDAKI_TEST_CHECK(same ? GDAKI_OK : 0xdadau, GDAKI_OK);
  } else {
    if (threadIdx.x < 32) {
      // A warp listens and stops listening together.
      uint32_t port = 0;
      GDAKI_TEST_CHECK(gdaki_socket_listen_warp(svc, 0, &port), GDAKI_OK);
      GDAKI_TEST_CHECK(port != 0 ? GDAKI_OK : 1u, GDAKI_OK);
      GDAKI_TEST_CHECK(gdaki_socket_unlisten_warp(svc, port), GDAKI_OK);
    }
    if (threadIdx.x == 0) {
      char closed[32];
      local_addr(closed, closed_port);
      GDAKI_TEST_CHECK(gdaki_socket_connect_thread(svc, closed, &s), GDAKI_CODE_REFUSED);
      GDAKI_TEST_CHECK(gdaki_socket_accept_thread(svc, closed_port, &s), GDAKI_CODE_REFUSED);
      GDAKI_TEST_CHECK(gdaki_socket_connect_thread(svc, 0, &s), GDAKI_CODE_BAD_ARGUMENT);
      GDAKI_TEST_CHECK(gdaki_socket_release_thread(svc, 0), GDAKI_CODE_BAD_ARGUMENT);
      GDAKI_TEST_CHECK(gdaki_socket_listen_thread(svc, 70000, 0), GDAKI_CODE_BAD_ARGUMENT);
      GDAKI_TEST_CHECK(gdaki_socket_connect_thread(0, closed, &s), GDAKI_CODE_BAD_HANDLE);
    }
  }
  status[t] = GDAKI_OK;
}
