// Counters the HCA advances when operations complete, from CUDA C++ through gdaki's C ABI:
// threads put on a data QP, then post on a cross-channel companion QP a WAIT for the put's
// completion and an atomic add on a counter (gdaki_count_when_done_*), in thread, warp and block
// scope; a last kernel waits for the counter. The test (cuda_cpp.rs) checks the data and the
// count. Region layout (bytes): [0, 8192) source; [65536, 73728) destination; the counter at
// 131072, the adds' fetched values at 131136.
#include "gdaki_layout_check.h"
#include "gdaki_test_check.h"

#define DST 65536
#define COUNTER 131072
#define SCRATCH 131136

// One thread (exclusive): 100 bytes counted by 3, then the refusals.
extern "C" __global__ void cpp_count_thread(gdaki_dev_qp *data, gdaki_dev_qp *comp, uint64_t base, uint32_t rkey,
                                            uint32_t lkey, uint32_t *status) {
  const unsigned t = 0;
  uint64_t ticket = 0, counted = 0;
  GDAKI_TEST_CHECK(gdaki_put_thread_exclusive(data, base + DST, rkey, base, lkey, 100, 0, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_count_when_done_thread_exclusive(comp, data, ticket, base + COUNTER, rkey, 3,
                                                          base + SCRATCH, lkey, 0, &counted),
                   GDAKI_OK);
  // No data QP, one of another layout version, a misaligned counter: nothing posted.
  gdaki_dev_qp stale = *data;
  stale.version += 1;
  GDAKI_TEST_CHECK(gdaki_count_when_done_thread_exclusive(comp, 0, ticket, base + COUNTER, rkey, 1, base + SCRATCH,
                                                          lkey, 0, 0),
                   GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_count_when_done_thread_exclusive(comp, &stale, ticket, base + COUNTER, rkey, 1,
                                                          base + SCRATCH, lkey, 0, 0),
                   GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_count_when_done_thread_exclusive(comp, data, ticket, base + COUNTER + 4, rkey, 1,
                                                          base + SCRATCH, lkey, 0, 0),
                   GDAKI_CODE_MISALIGNED);
  GDAKI_TEST_CHECK(gdaki_wait_thread_exclusive(comp, counted), GDAKI_OK);
  status[t] = GDAKI_OK;
}

// A warp (cta mode): lane l puts 64 bytes at 100 + 64 l, each lane counts 1 on the group's
// ticket. No lane waits on the data QP.
extern "C" __global__ void cpp_count_warp(gdaki_dev_qp *data, gdaki_dev_qp *comp, uint64_t base, uint32_t rkey,
                                          uint32_t lkey, uint32_t *status) {
  const unsigned t = threadIdx.x;
  uint64_t ticket = 0;
  const uint64_t at = 100 + 64 * t;
  GDAKI_TEST_CHECK(gdaki_put_warp_cta(data, base + DST + at, rkey, base + at, lkey, 64, 0, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_count_when_done_warp_cta(comp, data, ticket, base + COUNTER, rkey, 1, base + SCRATCH, lkey,
                                                  0, 0),
                   GDAKI_OK);
  status[t] = GDAKI_OK;
}

// A block (gpu mode): thread t puts 32 bytes at 2148 + 32 t and counts 1.
extern "C" __global__ void cpp_count_block(gdaki_dev_qp *data, gdaki_dev_qp *comp, uint64_t base, uint32_t rkey,
                                           uint32_t lkey, uint32_t *status) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = threadIdx.x;
  uint64_t ticket = 0;
  const uint64_t at = 2148 + 32 * t;
  GDAKI_TEST_CHECK(gdaki_put_block_gpu(data, &scratch, base + DST + at, rkey, base + at, lkey, 32, 0, &ticket),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_count_when_done_block_gpu(comp, &scratch, data, ticket, base + COUNTER, rkey, 1,
                                                   base + SCRATCH, lkey, 0, 0),
                   GDAKI_OK);
  status[t] = GDAKI_OK;
}

// One thread waits until the counter reads `value` (a load loop on local memory the HCA adds
// to, bounded by the QP's timeout).
extern "C" __global__ void cpp_await_count(gdaki_dev_qp *comp, uint64_t base, uint64_t value, uint32_t *status) {
  const unsigned t = 0;
  GDAKI_TEST_CHECK(gdaki_wait_signal_thread_exclusive(comp, (const uint64_t *)(base + COUNTER), value), GDAKI_OK);
  status[t] = GDAKI_OK;
}
