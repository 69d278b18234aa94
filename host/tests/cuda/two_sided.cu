// Two-sided verbs from CUDA C++ through gdaki's C ABI (gdaki_device.h): threads post receives,
// then SENDs, SENDs with immediate, inline SENDs and WRITEs with immediate go out in thread,
// warp and block scope, then every thread polls its own receive. The test (cuda_cpp.rs) runs
// them on a loopback queue pair with a receive queue and checks what landed where.
#include "gdaki_layout_check.h"
#include "gdaki_test_check.h"

// Region layout (bytes): [0, 8192) source data; receive buffers of 256 bytes from 131072, one
// per posting thread; the WRITE with immediate lands at 200000.
#define RECV_BASE 131072
#define RECV_LEN 256

// Every thread (any number of blocks, gpu mode) posts one receive into its own buffer and
// records its ticket: the order messages take receives in.
extern "C" __global__ void cpp_post_recvs(gdaki_dev_rq *rq, uint64_t base, uint32_t lkey, uint32_t *status,
                                          uint64_t *tickets) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  uint64_t ticket = ~0ull;
  GDAKI_TEST_CHECK(gdaki_post_recv_gpu(rq, base + RECV_BASE + RECV_LEN * t, lkey, RECV_LEN, &ticket), GDAKI_OK);
  tickets[t] = ticket;
  // Refusals: no handle, a handle of another layout version.
  gdaki_dev_rq stale = *rq;
  stale.version += 1;
  GDAKI_TEST_CHECK(gdaki_post_recv_gpu(0, base, lkey, 8, 0), GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_post_recv_gpu(&stale, base, lkey, 8, 0), GDAKI_CODE_BAD_HANDLE);
  // A batch without addresses is refused, an empty one posts nothing: neither takes a ticket.
  GDAKI_TEST_CHECK(gdaki_post_recvs_gpu(rq, 3, 0, lkey, 8, 0), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(gdaki_post_recvs_gpu(rq, 0, 0, lkey, 8, 0), GDAKI_OK);
  status[t] = GDAKI_OK;
}

// One thread: a SEND, a SEND with immediate, an inline SEND and a WRITE with immediate (the
// first four messages), and the refusals.
extern "C" __global__ void cpp_send_thread(gdaki_dev_qp *qp, uint64_t base, uint32_t rkey, uint32_t lkey,
                                           uint32_t *status) {
  const unsigned t = 0;
  uint64_t ticket = 0;
  GDAKI_TEST_CHECK(gdaki_send_thread_exclusive(qp, base, lkey, 100, 0, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_send_imm_thread_exclusive(qp, base + 100, lkey, 7, 0xabcu, 0, &ticket), GDAKI_OK);
  const char msg[] = "inline c++ send";
  GDAKI_TEST_CHECK(gdaki_send_inline_thread_exclusive(qp, msg, sizeof msg, GDAKI_POST_DEFER, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_commit_thread_exclusive(qp), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_write_imm_thread_exclusive(qp, base + 200000, rkey, base + 200, lkey, 64, 99, 0, &ticket),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_wait_thread_exclusive(qp, ticket), GDAKI_OK);
  char big[GDAKI_MAX_SEND_INLINE + 1] = {0};
  GDAKI_TEST_CHECK(gdaki_send_inline_thread_exclusive(qp, big, sizeof big, 0, 0), GDAKI_CODE_INLINE_TOO_LONG);
  GDAKI_TEST_CHECK(gdaki_send_thread_exclusive(qp, base, lkey, 1ull << 40, 0, 0), GDAKI_CODE_TOO_LONG);
  status[t] = GDAKI_OK;
}

// A warp (cta mode): lane l sends 64 bytes from 64 l with immediate l, one doorbell.
extern "C" __global__ void cpp_send_warp(gdaki_dev_qp *qp, uint64_t base, uint32_t lkey, uint32_t *status) {
  const unsigned t = threadIdx.x;
  uint64_t ticket = 0;
  GDAKI_TEST_CHECK(gdaki_send_imm_warp_cta(qp, base + 64 * t, lkey, 64, t, 0, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_wait_warp_cta(qp, ticket), GDAKI_OK);
  status[t] = GDAKI_OK;
}

// A block (gpu mode): thread t sends 32 bytes from 32 t.
extern "C" __global__ void cpp_send_block(gdaki_dev_qp *qp, uint64_t base, uint32_t lkey, uint32_t *status) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = threadIdx.x;
  GDAKI_TEST_CHECK(gdaki_send_block_gpu(qp, &scratch, base + 32 * t, lkey, 32, 0, 0), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_quiet_block_gpu(qp, &scratch), GDAKI_OK);
  status[t] = GDAKI_OK;
}

// Every thread sees whether its receive arrived; one whose receive took one of the first `n`
// messages polls it: its byte count, kind and immediate go to slot `ticket` of `got` (three
// words each).
extern "C" __global__ void cpp_poll_recvs(gdaki_dev_rq *rq, const uint64_t *tickets, uint64_t n, uint32_t *status,
                                          uint32_t *got) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t ticket = tickets[t];
  // Every message was sent (and waited for) before: the first `n` receives have arrived, the
  // rest have not; looking does not consume them.
  uint32_t arrived = 2;
  GDAKI_TEST_CHECK(gdaki_recv_arrived_gpu(rq, ticket, &arrived), GDAKI_OK);
  GDAKI_TEST_CHECK(arrived, ticket < n ? 1u : 0u);
  if (ticket >= n) {
    status[t] = GDAKI_OK;
    return;
  }
  GDAKI_TEST_CHECK(gdaki_wait_recv_arrived_gpu(rq, ticket), GDAKI_OK);
  uint32_t bytes = 0, kind = 0, imm = 0;
  GDAKI_TEST_CHECK(gdaki_poll_recv_gpu(rq, ticket, &bytes, &kind, &imm), GDAKI_OK);
  got[3 * ticket] = bytes;
  got[3 * ticket + 1] = kind;
  got[3 * ticket + 2] = imm;
  status[t] = GDAKI_OK;
}
