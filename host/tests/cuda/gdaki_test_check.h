// The check every test kernel of cuda_cpp.rs uses: a call whose status is not `expect` ends the
// thread, leaving `status[t] = __LINE__ << 16 | code` for the test to report (the kernel names
// its thread index `t` and its status array `status`).
#ifndef GDAKI_TEST_CHECK_H
#define GDAKI_TEST_CHECK_H
#define GDAKI_TEST_CHECK(call, expect)     \
  do {                                     \
    uint32_t c_ = (call);                  \
    if (c_ != (expect)) {                  \
      status[t] = (__LINE__ << 16) | c_;   \
      return;                              \
    }                                      \
  } while (0)
#endif
