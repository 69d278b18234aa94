// GPUnet's echo server and client in CUDA C++ over gdaki sockets: the host side through the C
// API (gdaki.h: listen, accept, connect, hand each socket to the GPU), the data path in kernels
// through gdaki_device.h, a block per connection (threadblock-cooperative receive and send).
// It speaks the same protocol as the Rust `sock_echo`, so either side may be either program.
//
//   echo --server [-p PORT] [-c CONNECTIONS] [--mem pinned|device]
//   echo HOST:PORT [-c CONNECTIONS] [-s BYTES] [-n MESSAGES] [--mem pinned|device]
//
// The client sends a known stream on each connection, message by message, reads each echo back
// and checks every byte. Exit status 0 when every connection did what it should.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gdaki.h"
#include "gdaki_device.h"

#define THREADS 256

// Byte i of a client's stream (the same as the Rust client's `pattern_byte`).
__device__ static uint8_t pattern_byte(uint64_t i) { return (uint8_t)((i * 131 + 7) ^ (i >> 8)); }

// Block b serves socks[b] until its client's end of stream, then closes; done[b] gets the bytes
// echoed, codes[b] the status of the call that failed (GDAKI_OK if none).
__global__ void echo_server(gdaki_dev_socket **socks, uint8_t *bufs, uint64_t buf_len, uint64_t *done,
                            uint32_t *codes) {
  __shared__ gdaki_block_scratch scratch;
  gdaki_dev_socket *s = socks[blockIdx.x];
  uint8_t *buf = bufs + buf_len * blockIdx.x;
  uint64_t total = 0;
  uint32_t code = GDAKI_OK;
  for (;;) {
    uint64_t n = 0;
    if ((code = gdaki_socket_recv_block_cta(s, &scratch, buf, buf_len, &n)) != GDAKI_OK || n == 0) break;
    if ((code = gdaki_socket_send_all_block_cta(s, &scratch, buf, n)) != GDAKI_OK) break;
    total += n;
  }
  if (code == GDAKI_OK) code = gdaki_socket_close_block_cta(s, &scratch);
  if (threadIdx.x == 0) {
    done[blockIdx.x] = total;
    codes[blockIdx.x] = code;
  }
}

// Block b sends `iters` messages of `len` bytes of its stream on socks[b], reads each echo back
// and compares it, then closes. A changed byte is code 0xdada.
__global__ void echo_client(gdaki_dev_socket **socks, uint8_t *bufs, uint64_t len, uint32_t iters, uint64_t *done,
                            uint32_t *codes) {
  __shared__ gdaki_block_scratch scratch;
  __shared__ int wrong;
  gdaki_dev_socket *s = socks[blockIdx.x];
  uint8_t *buf = bufs + len * blockIdx.x;
  uint32_t code = GDAKI_OK;
  for (uint32_t k = 0; k < iters && code == GDAKI_OK; k++) {
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) buf[i] = pattern_byte(k * len + i);
    __syncthreads();
    if ((code = gdaki_socket_send_all_block_cta(s, &scratch, buf, len)) != GDAKI_OK) break;
    if ((code = gdaki_socket_recv_exact_block_cta(s, &scratch, buf, len)) != GDAKI_OK) break;
    if (threadIdx.x == 0) wrong = 0;
    __syncthreads();
    for (uint64_t i = threadIdx.x; i < len; i += blockDim.x)
      if (buf[i] != pattern_byte(k * len + i)) wrong = 1;
    __syncthreads();
    if (wrong) code = 0xdada;
    __syncthreads();
  }
  if (code == GDAKI_OK) code = gdaki_socket_close_block_cta(s, &scratch);
  if (threadIdx.x == 0) {
    done[blockIdx.x] = code == GDAKI_OK ? len * iters : 0;
    codes[blockIdx.x] = code;
  }
}

static void die(const char *what, gdaki_status s) {
  std::fprintf(stderr, "echo: %s: status %d: %s\n", what, (int)s, gdaki_last_error());
  std::exit(1);
}
#define GDAKI(call)                         \
  do {                                      \
    gdaki_status s_ = (call);               \
    if (s_ != GDAKI_STATUS_OK) die(#call, s_); \
  } while (0)
#define CUDA(call)                                                                      \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "echo: %s: %s\n", #call, cudaGetErrorString(e_));            \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

static void usage() {
  std::fprintf(stderr,
               "usage: echo --server [-p PORT] [-c CONNECTIONS] [--mem pinned|device]\n"
               "       echo HOST:PORT [-c CONNECTIONS] [-s BYTES] [-n MESSAGES] [--mem pinned|device]\n");
  std::exit(2);
}

int main(int argc, char **argv) {
  bool server = false;
  std::string addr;
  unsigned port = 18517, connections = 1, iters = 1000;
  uint64_t size = 4096;
  uint32_t memory = GDAKI_SOCKET_MEMORY_PINNED;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto value = [&]() -> const char * { return i + 1 < argc ? argv[++i] : (usage(), nullptr); };
    if (a == "--server") server = true;
    else if (a == "-p") port = std::strtoul(value(), nullptr, 10);
    else if (a == "-c") connections = std::strtoul(value(), nullptr, 10);
    else if (a == "-s") size = std::strtoull(value(), nullptr, 10);
    else if (a == "-n") iters = std::strtoul(value(), nullptr, 10);
    else if (a == "--mem") {
      std::string m = value();
      if (m == "pinned") memory = GDAKI_SOCKET_MEMORY_PINNED;
      else if (m == "device") memory = GDAKI_SOCKET_MEMORY_DEVICE;
      else usage();
    } else if (a[0] != '-' && addr.empty()) addr = a;
    else usage();
  }
  if (server == !addr.empty() || connections == 0 || connections > 1024 || size == 0 || iters == 0) usage();

  // Load both kernels now, before a socket with rings in GPU memory starts the soft HCA's
  // resident copier kernel: CUDA loads modules lazily, and a load behind a resident kernel
  // waits for it forever (docs/stream.md).
  cudaFuncAttributes attr;
  CUDA(cudaFuncGetAttributes(&attr, echo_server));
  CUDA(cudaFuncGetAttributes(&attr, echo_client));

  gdaki_context *ctx = nullptr;
  gdaki_gpu *gpu = nullptr;
  GDAKI(gdaki_context_open(GDAKI_PROVIDER_SOFT, nullptr, &ctx));
  GDAKI(gdaki_gpu_open(0, &gpu));
  gdaki_socket_config cfg;
  GDAKI(gdaki_socket_config_init(&cfg));
  cfg.memory = memory;
  cfg.gpu = gpu;
  cfg.timeout_ms = 60000;
  if (size > cfg.rx_bytes) {
    std::fprintf(stderr, "echo: -s %llu: at most the receive ring (%llu bytes)\n", (unsigned long long)size,
                 (unsigned long long)cfg.rx_bytes);
    return 2;
  }

  // The connections, each handed to the GPU.
  std::vector<gdaki_socket *> plain(connections);
  gdaki_socket_listener *listener = nullptr;
  if (server) {
    std::string at = "0.0.0.0:" + std::to_string(port);
    GDAKI(gdaki_socket_listen(ctx, at.c_str(), &cfg, &listener));
    std::fprintf(stderr, "echo: serving %u connection(s) on port %u\n", connections, port);
    for (auto &s : plain) GDAKI(gdaki_socket_accept(listener, 60000, &s));
  } else {
    if (addr.find(':') == std::string::npos) addr += ":" + std::to_string(port);
    for (auto &s : plain) GDAKI(gdaki_socket_connect(ctx, addr.c_str(), &cfg, &s));
  }
  std::vector<gdaki_gpu_socket *> on_gpu(connections);
  std::vector<gdaki_dev_socket *> handles(connections);
  for (unsigned i = 0; i < connections; i++) {
    GDAKI(gdaki_socket_export_gpu(&plain[i], gpu, &on_gpu[i]));
    GDAKI(gdaki_gpu_socket_handle(on_gpu[i], &handles[i]));
  }

  // One kernel, a block per connection, on a stream of its own (the soft HCA's copier kernel
  // may be running: nothing here waits for every kernel of the device).
  gdaki_dev_socket **d_handles;
  uint8_t *d_bufs;
  uint64_t *d_done;
  uint32_t *d_codes;
  uint64_t buf_len = server ? cfg.rx_bytes : size;
  CUDA(cudaMalloc(&d_handles, sizeof(void *) * connections));
  CUDA(cudaMalloc(&d_bufs, buf_len * connections));
  CUDA(cudaMalloc(&d_done, sizeof(uint64_t) * connections));
  CUDA(cudaMalloc(&d_codes, sizeof(uint32_t) * connections));
  CUDA(cudaMemcpy(d_handles, handles.data(), sizeof(void *) * connections, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto start = std::chrono::steady_clock::now();
  if (server)
    echo_server<<<connections, THREADS, 0, stream>>>(d_handles, d_bufs, buf_len, d_done, d_codes);
  else
    echo_client<<<connections, THREADS, 0, stream>>>(d_handles, d_bufs, size, iters, d_done, d_codes);
  CUDA(cudaGetLastError());
  CUDA(cudaStreamSynchronize(stream));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<uint64_t> done(connections);
  std::vector<uint32_t> codes(connections);
  CUDA(cudaMemcpyAsync(done.data(), d_done, sizeof(uint64_t) * connections, cudaMemcpyDeviceToHost, stream));
  CUDA(cudaMemcpyAsync(codes.data(), d_codes, sizeof(uint32_t) * connections, cudaMemcpyDeviceToHost, stream));
  CUDA(cudaStreamSynchronize(stream));

  int failed = 0;
  uint64_t total = 0;
  for (unsigned i = 0; i < connections; i++) {
    if (codes[i] != GDAKI_OK) {
      std::fprintf(stderr, "echo: connection %u failed with code %#x\n", i, codes[i]);
      failed = 1;
    } else if (server) {
      std::fprintf(stderr, "echo: connection %u echoed %llu bytes\n", i, (unsigned long long)done[i]);
    }
    total += done[i];
  }
  if (!server && !failed)
    std::printf("%u connection(s): %u x %llu B each, every byte echoed and checked\n%.3f s, %.0f round trips/s\n",
                connections, iters, (unsigned long long)size, seconds, connections * (double)iters / seconds);
  // The sockets (and with them any device-memory rings) go before the CUDA memory is freed.
  for (auto g : on_gpu) GDAKI(gdaki_gpu_socket_destroy(g));
  GDAKI(gdaki_socket_listener_destroy(listener));
  CUDA(cudaStreamDestroy(stream));
  CUDA(cudaFree(d_handles));
  CUDA(cudaFree(d_bufs));
  CUDA(cudaFree(d_done));
  CUDA(cudaFree(d_codes));
  GDAKI(gdaki_gpu_destroy(gpu));
  GDAKI(gdaki_context_destroy(ctx));
  return failed;
}
