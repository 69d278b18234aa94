// Kernels written against gdaki_gin.cuh, the NCCL GIN-shaped handle: two PEs in one kernel,
// each with a queue pair to the other, a data window, a signal window and scratch, all in one
// GPU-mapped region the test checks afterwards. With `map` set, each PE maps the other's
// windows (Window::mapped) and has no queue pair to it: every put, value and signal must take
// the load/store path (through a queue pair they would be refused).
#include "gdaki_gin.cuh"
#include "gdaki_test_check.h"

// Region layout (bytes): PE p's data window at 65536 p (64 KiB; the host fills PE 0's first
// 4096 bytes), its signal words at 131072 + 512 p (64 words), its scratch at 135168 + 64 p.

struct Pes {
  gdaki_remote_region data[2], sig[2];
  uint64_t data_at[2], sig_at[2];
  gdaki_dev_qp *qps[2][2];
  gdaki::Window data_of[2], sig_of[2], scratch_of[2];

  __device__ Pes(uint64_t base, uint32_t rkey, uint32_t lkey, gdaki_dev_qp *const *qps0, gdaki_dev_qp *const *qps1,
                 uint32_t map) {
    for (int p = 0; p < 2; p++) {
      data[p] = gdaki_remote_region{base + 65536ull * p, 65536, rkey, 0};
      sig[p] = gdaki_remote_region{base + 131072 + 512ull * p, 512, rkey, 0};
      data_at[p] = data[p].addr;
      sig_at[p] = sig[p].addr;
    }
    for (int p = 0; p < 2; p++) {
      data_of[p] = gdaki::Window{data[p].addr, 65536, lkey, 2, data, map ? data_at : nullptr};
      sig_of[p] = gdaki::Window{sig[p].addr, 512, lkey, 2, sig, map ? sig_at : nullptr};
      scratch_of[p] = gdaki::Window{base + 135168 + 64ull * p, 64, lkey, 0, nullptr};
    }
    // PE p's queue pair to itself stays (wait_signal bounds its wait by a queue pair's timeout).
    qps[0][0] = qps0[0];
    qps[0][1] = map ? nullptr : qps0[1];
    qps[1][0] = map ? nullptr : qps1[0];
    qps[1][1] = qps1[1];
  }
  template <class Mode>
  __device__ gdaki::Gin<Mode> pe(int p) const {
    return gdaki::Gin<Mode>(qps[p], 2, sig_of[p], scratch_of[p]);
  }
};

// One thread: every method, both directions, and the refusals.
extern "C" __global__ void gin_thread(gdaki_dev_qp *const *qps0, uint32_t, gdaki_dev_qp *const *qps1, uint32_t,
                                      uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status, uint32_t map) {
  const unsigned t = 0;
  Pes w(base, rkey, lkey, qps0, qps1, map);
  auto pe0 = w.pe<gdaki::Exclusive>(0);
  auto pe1 = w.pe<gdaki::Exclusive>(1);
  const gdaki::Window &data = w.data_of[0];
  GDAKI_TEST_CHECK(pe0.put(1, data, 0, data, 0, 4096, gdaki::SignalInc{0}), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Thread{}, 0, 1), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.put_value(1, data, 8192, (uint64_t)0x1122334455667788ull, gdaki::SignalAdd{1, 5}), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Thread{}, 1, 5), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.put_value(1, data, 8200, (uint32_t)0xa5a5a5a5u), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.signal(1, gdaki::SignalAdd{2, 9}), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.flush(), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.read_signal(2) == 9 ? GDAKI_OK : 99u, GDAKI_OK);
  // PE 1 back to PE 0, from the data PE 0 just sent it.
  GDAKI_TEST_CHECK(pe1.put(0, w.data_of[1], 16384, w.data_of[1], 0, 256), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.flush(), GDAKI_OK);
  // Refused before anything is posted.
  GDAKI_TEST_CHECK(pe0.put(2, data, 0, data, 0, 8), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.put(1, data, 65536 - 8, data, 0, 16), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.put(1, data, 0, data, 65536 - 8, 16), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.signal(1, gdaki::None{}), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.signal(1, gdaki::SignalInc{64}), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Thread{}, 64, 1), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe1.read_signal(64) == 0 ? GDAKI_OK : 99u, GDAKI_OK);
  status[t] = 0;
}

// A warp makes one put together (2048 bytes, one signal add), then one value; lanes that name
// different peers, or different offsets, are refused together (no deadlock).
extern "C" __global__ void gin_warp(gdaki_dev_qp *const *qps0, uint32_t, gdaki_dev_qp *const *qps1, uint32_t,
                                    uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status, uint32_t map) {
  const unsigned t = threadIdx.x;
  Pes w(base, rkey, lkey, qps0, qps1, map);
  auto pe0 = w.pe<gdaki::Cta>(0);
  auto pe1 = w.pe<gdaki::Cta>(1);
  const gdaki::Window &data = w.data_of[0];
  GDAKI_TEST_CHECK(pe0.put(t & 1, data, 0, data, 0, 8, gdaki::None{}, gdaki::Warp{}), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.put(1, data, 64 * t, data, 0, 8, gdaki::None{}, gdaki::Warp{}), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.put(1, data, 32768, data, 0, 2048, gdaki::SignalInc{3}, gdaki::Warp{}), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Warp{}, 3, 1), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.put_value(1, data, 34816, (uint64_t)0x0f0e0d0c0b0a0908ull, gdaki::SignalInc{3}, gdaki::Warp{}),
                   GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Warp{}, 3, 2), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.flush(gdaki::Warp{}), GDAKI_OK);
  status[t] = 0;
}

// A block of 256 makes one put together (4096 bytes), then one at odd offsets (1000 bytes from
// byte 3 to byte 3 of a line: the copy's byte path), one signal add each; members that pass
// different sizes are refused together.
extern "C" __global__ void gin_block(gdaki_dev_qp *const *qps0, uint32_t, gdaki_dev_qp *const *qps1, uint32_t,
                                     uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status, uint32_t map) {
  __shared__ gdaki_block_scratch scratch;
  const unsigned t = threadIdx.x;
  Pes w(base, rkey, lkey, qps0, qps1, map);
  auto pe0 = w.pe<gdaki::Gpu>(0);
  auto pe1 = w.pe<gdaki::Gpu>(1);
  gdaki::Block block{&scratch};
  const gdaki::Window &data = w.data_of[0];
  GDAKI_TEST_CHECK(pe0.put(1, data, 0, data, 0, t == 7 ? 16 : 8, gdaki::None{}, block), GDAKI_CODE_BAD_ARGUMENT);
  GDAKI_TEST_CHECK(pe0.put(1, data, 40960, data, 0, 4096, gdaki::SignalInc{4}, block), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.put(1, data, 45059, data, 3, 1000, gdaki::SignalInc{4}, block), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.wait_signal(block, 4, 2), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.signal(1, gdaki::SignalAdd{4, 10}, block), GDAKI_OK);
  GDAKI_TEST_CHECK(pe0.flush(block), GDAKI_OK);
  status[t] = 0;
}

// Each path for the data with the other for the signal, one thread: stores, then the signal
// through the queue pair; a put through the queue pair, then the signal by a system-scope
// atomic (after the put's completion).
extern "C" __global__ void gin_mixed(gdaki_dev_qp *const *qps0, uint32_t, gdaki_dev_qp *const *qps1, uint32_t,
                                     uint64_t base, uint32_t rkey, uint32_t lkey, uint32_t *status, uint32_t) {
  const unsigned t = 0;
  Pes w(base, rkey, lkey, qps0, qps1, 0);
  gdaki::Window data_mapped = w.data_of[0], sig_mapped = w.sig_of[0];
  data_mapped.mapped = w.data_at;
  sig_mapped.mapped = w.sig_at;
  gdaki::Gin<gdaki::Exclusive> stores_then_qp(w.qps[0], 2, w.sig_of[0], w.scratch_of[0]);
  gdaki::Gin<gdaki::Exclusive> qp_then_atomic(w.qps[0], 2, sig_mapped, w.scratch_of[0]);
  GDAKI_TEST_CHECK(stores_then_qp.put(1, data_mapped, 57344, data_mapped, 0, 1000, gdaki::SignalInc{5}), GDAKI_OK);
  GDAKI_TEST_CHECK(qp_then_atomic.put(1, w.data_of[0], 58368, w.data_of[0], 1000, 1000, gdaki::SignalAdd{6, 3}), GDAKI_OK);
  GDAKI_TEST_CHECK(qp_then_atomic.put_value(1, w.data_of[0], 59392, (uint64_t)0x0102030405060708ull, gdaki::SignalInc{6}),
            GDAKI_OK);
  GDAKI_TEST_CHECK(stores_then_qp.flush(), GDAKI_OK);
  auto pe1 = w.pe<gdaki::Exclusive>(1);
  GDAKI_TEST_CHECK(pe1.wait_signal(gdaki::Thread{}, 5, 1), GDAKI_OK);
  GDAKI_TEST_CHECK(pe1.read_signal(6) == 4 ? GDAKI_OK : 99u, GDAKI_OK);
  status[t] = 0;
}
