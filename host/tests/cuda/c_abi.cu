// CUDA C++ kernels that call gdaki's C ABI (gdaki_device.h), as an embedder writes them. The
// test links them with gdaki's device code at run time (NVRTC, then the driver's linker) and
// ahead of time (nvcc -rdc against libgdaki_device.a), and checks what they wrote.
#include "gdaki_layout_check.h"
#include "gdaki_test_check.h"

// Region layout (bytes, per thread t where noted): [0, 4096) source data; [4096 + 64t) puts;
// [65536 + 64t) gets; 120000 signal word; 120008 scratch; 120016 atomic word; 120024 result.

// One thread, exclusive mode: every operation once, and the refusals.
extern "C" __global__ void cpp_thread_ops(gdaki_dev_qp *qp, uint64_t base, uint32_t rkey, uint32_t lkey,
                                          uint32_t *status, uint64_t *out) {
  const unsigned t = 0;
  uint64_t ticket = 0, fetched = 0;
  GDAKI_TEST_CHECK(gdaki_put_thread_exclusive(qp, base + 4096, rkey, base, lkey, 64, 0, &ticket), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_get_thread_exclusive(qp, base + 65536, lkey, base + 4096, rkey, 64, GDAKI_POST_FENCE, &ticket),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_wait_thread_exclusive(qp, ticket), GDAKI_OK);
  const char msg[] = "c++ inline";
  GDAKI_TEST_CHECK(gdaki_put_inline_thread_exclusive(qp, base + 8192, rkey, msg, sizeof msg, GDAKI_POST_DEFER, 0),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_commit_thread_exclusive(qp), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_put_signal_thread_exclusive(qp, base + 8448, rkey, base, lkey, 32, base + 120000, rkey, 2,
                                                     base + 120008, lkey, 0, 0),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_signal_thread_exclusive(qp, base + 120000, rkey, 1, base + 120008, lkey, 0, 0), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_wait_signal_thread_exclusive(qp, (const uint64_t *)(base + 120000), 3), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_atomic_fetch_add_thread_exclusive(qp, base + 120016, rkey, 5, base + 120024, lkey, 0, &fetched),
                   GDAKI_OK);
  out[0] = fetched;
  GDAKI_TEST_CHECK(gdaki_atomic_compare_swap_thread_exclusive(qp, base + 120016, rkey, fetched + 5, 77, base + 120024,
                                                              lkey, 0, &fetched),
                   GDAKI_OK);
  out[1] = fetched;
  GDAKI_TEST_CHECK(gdaki_quiet_thread_exclusive(qp), GDAKI_OK);
  // Refusals: no handle, a handle of another layout version, unknown flags.
  gdaki_dev_qp stale = *qp;
  stale.version += 1;
  GDAKI_TEST_CHECK(gdaki_put_thread_exclusive(0, base, rkey, base, lkey, 8, 0, 0), GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_put_thread_exclusive(&stale, base, rkey, base, lkey, 8, 0, 0), GDAKI_CODE_BAD_HANDLE);
  GDAKI_TEST_CHECK(gdaki_put_thread_exclusive(qp, base, rkey, base, lkey, 8, 0x80, 0), GDAKI_CODE_BAD_ARGUMENT);
  status[t] = GDAKI_OK;
}

// A warp (cta mode): each lane puts its own 64 bytes, the warp posts them with one doorbell.
extern "C" __global__ void cpp_warp_put(gdaki_dev_qp *qp, uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status) {
  const unsigned t = threadIdx.x;
  uint64_t ticket = 0;
  GDAKI_TEST_CHECK(gdaki_put_warp_cta(qp, base + 16384 + 64 * t, rkey, base + 64 * (t % 64), lkey, 64, 0, &ticket),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_wait_warp_cta(qp, ticket), GDAKI_OK);
  status[t] = GDAKI_OK;
}

// A block (gpu mode) with its scratch in shared memory: each thread puts its own 64 bytes.
extern "C" __global__ void cpp_block_put(gdaki_dev_qp *qp, uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = threadIdx.x;
  GDAKI_TEST_CHECK(gdaki_put_block_gpu(qp, &scratch, base + 32768 + 64 * t, rkey, base + 64 * (t % 64), lkey, 64, 0, 0),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_quiet_block_gpu(qp, &scratch), GDAKI_OK);
  GDAKI_TEST_CHECK(gdaki_put_block_gpu(qp, 0, base, rkey, base, lkey, 8, 0, 0), GDAKI_CODE_BAD_ARGUMENT);
  status[t] = GDAKI_OK;
}
