/* The C API from C, on the soft HCA in CPU mode: every call's success path, the data path
 * through gdaki_device.h's thread-scope functions on the host, and every error path a C
 * program can reach (NULLs, wrong handles, bad values, short buffers, refused peers, timeouts,
 * error completions). Exits 0 when every check passed; prints each failure with the call's
 * gdaki_last_error(). */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "gdaki.h"

static int failures;
static int checks;

#define EXPECT(status, call)                                                                  \
    do {                                                                                      \
        gdaki_status got_ = (call);                                                           \
        checks++;                                                                             \
        if (got_ != (status)) {                                                               \
            failures++;                                                                       \
            fprintf(stderr, "%s:%d: %s gave %s, expected %s (%s)\n", __FILE__, __LINE__, #call, \
                    gdaki_status_name(got_), gdaki_status_name(status), gdaki_last_error());  \
        }                                                                                     \
    } while (0)
#define OK(call) EXPECT(GDAKI_STATUS_OK, call)
#define CHECK(cond)                                                                    \
    do {                                                                               \
        checks++;                                                                      \
        if (!(cond)) {                                                                 \
            failures++;                                                                \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                              \
    } while (0)
/* The last error names the call and says something about the value. */
#define LAST_ERROR_HAS(text) CHECK(strstr(gdaki_last_error(), (text)) != NULL)

static gdaki_context *ctx;

static void library(void) {
    CHECK(gdaki_abi_version() == GDAKI_ABI_VERSION);
    CHECK(strlen(gdaki_version()) > 0);
    CHECK(strcmp(gdaki_status_name(GDAKI_STATUS_TIMEOUT), "GDAKI_STATUS_TIMEOUT") == 0);
    CHECK(strcmp(gdaki_status_name(4242), "GDAKI_STATUS_UNKNOWN") == 0);
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_log_init("gdaki=loudest"));
    LAST_ERROR_HAS("gdaki_log_init");
    OK(gdaki_log_init("warn"));
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_log_init(NULL));
}

static void contexts(void) {
    gdaki_context *c = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_context_open(GDAKI_PROVIDER_SOFT, NULL, NULL));
    LAST_ERROR_HAS("gdaki_context_open: ctx is NULL");
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_context_open(7, NULL, &c));
    LAST_ERROR_HAS("provider 7");
    EXPECT(GDAKI_STATUS_DEVICE, gdaki_context_open(GDAKI_PROVIDER_SOFT, "mlx5_9", &c));
    if (access("/sys/class/infiniband", F_OK) != 0) {
        EXPECT(GDAKI_STATUS_NO_DEVICE, gdaki_context_open(GDAKI_PROVIDER_MLX5, NULL, &c));
    }
    CHECK(c == NULL);
    OK(gdaki_context_open(GDAKI_PROVIDER_SOFT, "soft", &ctx));
    gdaki_provider p = GDAKI_PROVIDER_AUTO;
    OK(gdaki_context_provider(ctx, &p));
    CHECK(p == GDAKI_PROVIDER_SOFT);
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_context_provider(NULL, &p));

    size_t len = 0;
    EXPECT(GDAKI_STATUS_BUFFER_TOO_SMALL, gdaki_context_device_name(ctx, NULL, 0, &len));
    CHECK(len == 4);
    char small[4];
    EXPECT(GDAKI_STATUS_BUFFER_TOO_SMALL, gdaki_context_device_name(ctx, small, sizeof small, NULL));
    char name[16];
    OK(gdaki_context_device_name(ctx, name, sizeof name, &len));
    CHECK(strcmp(name, "soft") == 0 && len == 4);

    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_context_listen(ctx, "not an address", name, sizeof name, NULL));
    char addr[64];
    OK(gdaki_context_listen(ctx, "127.0.0.1:0", addr, sizeof addr, &len));
    CHECK(strncmp(addr, "127.0.0.1:", 10) == 0 && len == strlen(addr));

    /* A GPU: none on CI; where there is one, it opens. */
    gdaki_gpu *gpu = NULL;
    gdaki_status s = gdaki_gpu_open(0, &gpu);
    CHECK(s == GDAKI_STATUS_OK || s == GDAKI_STATUS_NO_DEVICE);
    uint32_t gpus = 99;
    OK(gdaki_gpu_count(&gpus));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_gpu_count(NULL));
    CHECK((s == GDAKI_STATUS_OK) == (gpus > 0));
    /* Peer maps: bytes that are no export are refused; host memory cannot be exported. */
    gdaki_peer_export junk;
    memset(&junk, 0x5a, sizeof junk);
    gdaki_peer_map *map = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_peer_map_open(NULL, &junk, &map));
    OK(gdaki_peer_map_destroy(NULL));
    if (s == GDAKI_STATUS_OK) {
        gdaki_gpu *none = NULL;
        EXPECT(GDAKI_STATUS_NO_DEVICE, gdaki_gpu_open(4096, &none));
        uint8_t uuid[16] = {0}, zero[16] = {0};
        OK(gdaki_gpu_uuid(gpu, uuid));
        CHECK(memcmp(uuid, zero, 16) != 0);
        EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_gpu_uuid(gpu, NULL));
        EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_peer_map_open(gpu, &junk, &map));
        LAST_ERROR_HAS("wrong magic");
        gdaki_region *host = NULL, *dev = NULL;
        OK(gdaki_region_alloc(ctx, 4096, GDAKI_ACCESS_ALL, &host));
        EXPECT(GDAKI_STATUS_UNSUPPORTED, gdaki_region_export_peer(host, gpu, &junk));
        LAST_ERROR_HAS("host memory");
        OK(gdaki_region_alloc_device(ctx, gpu, 4096, GDAKI_ACCESS_ALL, &dev));
        gdaki_peer_export mine;
        OK(gdaki_region_export_peer(dev, gpu, &mine));
        EXPECT(GDAKI_STATUS_UNSUPPORTED, gdaki_peer_map_open(gpu, &mine, &map));
        LAST_ERROR_HAS("this process's own");
        OK(gdaki_region_destroy(dev));
        OK(gdaki_region_destroy(host));
        OK(gdaki_gpu_destroy(gpu));
    } else {
        printf("api_test: no usable GPU (%s): GPU calls checked for their error only\n", gdaki_last_error());
    }
    OK(gdaki_gpu_destroy(NULL));
    OK(gdaki_context_destroy(NULL));
}

static void regions(void) {
    gdaki_region *r = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_region_alloc(ctx, 4096, 0x100, &r));
    LAST_ERROR_HAS("access 0x100");
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_region_alloc(NULL, 4096, GDAKI_ACCESS_ALL, &r));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_region_alloc(ctx, 4096, GDAKI_ACCESS_ALL, NULL));
    OK(gdaki_region_alloc(ctx, 8192, GDAKI_ACCESS_ALL, &r));

    /* A handle of another type is refused, not used. */
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_context_provider((const gdaki_context *)r, &(gdaki_provider){0}));
    LAST_ERROR_HAS("not a live gdaki_context handle");
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_region_destroy((gdaki_region *)ctx));

    gdaki_region_info info;
    OK(gdaki_region_query(r, &info));
    CHECK(info.len == 8192 && info.access == GDAKI_ACCESS_ALL && info.lkey != 0 && info.rkey != 0);
    CHECK(info.gpu == -1 && info.device_memory == 0 && info.library_owned == 1);
    gdaki_remote_region remote;
    OK(gdaki_region_remote(r, &remote));
    CHECK(remote.addr == info.addr && remote.len == 8192 && remote.rkey == info.rkey);

    char text[] = "written from C";
    char back[sizeof text];
    OK(gdaki_region_write(r, 100, text, sizeof text));
    OK(gdaki_region_read(r, 100, back, sizeof back));
    CHECK(memcmp(text, back, sizeof text) == 0);
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_region_read(r, 8190, back, 4));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_region_read(r, 0, NULL, 4));
    OK(gdaki_region_read(r, 0, NULL, 0));

    /* Caller memory: registered, never read by the library for the caller. */
    void *mine = aligned_alloc(4096, 4096);
    gdaki_region *caller = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_region_register_host(ctx, NULL, 4096, GDAKI_ACCESS_ALL, &caller));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_region_register_host(ctx, mine, 0, GDAKI_ACCESS_ALL, &caller));
    OK(gdaki_region_register_host(ctx, mine, 4096, GDAKI_ACCESS_ALL, &caller));
    OK(gdaki_region_query(caller, &info));
    CHECK(info.addr == (uint64_t)(uintptr_t)mine && info.library_owned == 0);
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_region_read(caller, 0, back, 4));
    LAST_ERROR_HAS("caller-registered");
    OK(gdaki_region_destroy(caller));
    free(mine);
    OK(gdaki_region_destroy(r));
    OK(gdaki_region_destroy(NULL));
}

/* A loopback QP with its own CQ. */
static gdaki_qp *loopback(gdaki_cq **cq, uint32_t doorbell) {
    gdaki_qp_config cfg;
    OK(gdaki_qp_config_init(&cfg));
    cfg.sq_size = 64;
    cfg.doorbell = doorbell;
    cfg.timeout_ms = 5000;
    cfg.retry_timeout_ms = 1000;
    gdaki_qp *qp = NULL;
    OK(gdaki_cq_create(ctx, 64, NULL, cq));
    OK(gdaki_qp_create(ctx, *cq, &cfg, &qp));
    gdaki_endpoint self;
    OK(gdaki_qp_endpoint(qp, &self));
    OK(gdaki_qp_connect(qp, &self));
    return qp;
}

static void queues(void) {
    gdaki_cq *cq = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_cq_create(ctx, 3, NULL, &cq));
    LAST_ERROR_HAS("power of two");
    OK(gdaki_cq_create(ctx, 64, NULL, &cq));

    gdaki_qp_config cfg;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_qp_config_init(NULL));
    OK(gdaki_qp_config_init(&cfg));
    CHECK(cfg.sq_size == 1024 && cfg.doorbell == GDAKI_DOORBELL_GPU && cfg.rings_gpu == NULL);
    gdaki_qp *qp = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, cq, &cfg, &qp)); /* 1024 > the CQ's 64 */
    cfg.sq_size = 64;
    cfg.doorbell = 9;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, cq, &cfg, &qp));
    LAST_ERROR_HAS("doorbell 9");
    cfg.doorbell = GDAKI_DOORBELL_GPU;
    cfg.timeout_ms = 0;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, cq, &cfg, &qp));
    cfg.timeout_ms = 5000;
    cfg.rings_gpu = (const gdaki_gpu *)cq;
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_qp_create(ctx, cq, &cfg, &qp));
    cfg.rings_gpu = NULL;
    OK(gdaki_qp_create(ctx, cq, &cfg, &qp));
    gdaki_qp *second = NULL;
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_qp_create(ctx, cq, &cfg, &second));
    LAST_ERROR_HAS("already serves");
    CHECK(second == NULL);

    gdaki_qp_info info;
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RESET && info.qpn != 0 && info.syndrome == 0);
    CHECK(info.doorbell == GDAKI_DOORBELL_GPU && info.rings_in_gpu_memory == 0);

    gdaki_endpoint ep, bad;
    OK(gdaki_qp_endpoint(qp, &ep));
    bad = ep;
    bad.bytes[0] ^= 0xff;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_connect(qp, &bad));
    LAST_ERROR_HAS("not a gdaki peer");
    bad = ep;
    bad.bytes[GDAKI_ENDPOINT_BYTES - 1] = 1;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_connect(qp, &bad));
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RESET); /* nothing changed */
    OK(gdaki_qp_connect(qp, &ep));
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RTS);
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_qp_connect(qp, &ep));

    /* Destroy order does not matter: the QP keeps its CQ. */
    OK(gdaki_cq_destroy(cq));
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RTS);
    OK(gdaki_qp_destroy(qp));
}

/* The data path from C on the host: gdaki_device.h's thread-scope functions. */
static void data_path(void) {
    gdaki_cq *cq = NULL;
    gdaki_qp *qp = loopback(&cq, GDAKI_DOORBELL_GPU);
    gdaki_dev_qp *h = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_qp_host_handle(qp, NULL));
    OK(gdaki_qp_host_handle(qp, &h));
    CHECK(h != NULL && h->version == GDAKI_DEV_QP_VERSION);

    gdaki_region *src = NULL, *dst = NULL;
    OK(gdaki_region_alloc(ctx, 65536, GDAKI_ACCESS_ALL, &src));
    OK(gdaki_region_alloc(ctx, 65536, GDAKI_ACCESS_ALL, &dst));
    gdaki_region_info s, d;
    OK(gdaki_region_query(src, &s));
    OK(gdaki_region_query(dst, &d));
    static unsigned char pattern[65536];
    for (size_t i = 0; i < sizeof pattern; i++) pattern[i] = (unsigned char)(i * 7 + 3);
    OK(gdaki_region_write(src, 0, pattern, sizeof pattern));

    uint64_t ticket = 0;
    CHECK(gdaki_put_thread_exclusive(h, d.addr, d.rkey, s.addr, s.lkey, 65536, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    static unsigned char got[65536];
    OK(gdaki_region_read(dst, 0, got, sizeof got));
    CHECK(memcmp(got, pattern, sizeof got) == 0);

    const char word[] = "inline!";
    CHECK(gdaki_put_inline_thread_exclusive(h, d.addr + 8, d.rkey, word, sizeof word, 0, NULL) == GDAKI_OK);
    CHECK(gdaki_quiet_thread_exclusive(h) == GDAKI_OK);
    char back[sizeof word];
    OK(gdaki_region_read(dst, 8, back, sizeof back));
    CHECK(memcmp(back, word, sizeof word) == 0);

    /* A fetch-add on a word of dst, the old value read back into src. */
    uint64_t zero = 5, fetched = 0;
    OK(gdaki_region_write(dst, 4096, &zero, sizeof zero));
    CHECK(gdaki_atomic_fetch_add_thread_exclusive(h, d.addr + 4096, d.rkey, 10, s.addr + 8192, s.lkey, 0, &fetched) ==
          GDAKI_OK);
    CHECK(fetched == 5);
    uint64_t now = 0;
    OK(gdaki_region_read(dst, 4096, &now, sizeof now));
    CHECK(now == 15);

    /* Deferred posts ring once, at commit. */
    for (int i = 0; i < 4; i++) {
        CHECK(gdaki_put_thread_exclusive(h, d.addr + 16384 + i * 64, d.rkey, s.addr, s.lkey, 64, GDAKI_POST_DEFER,
                                         &ticket) == GDAKI_OK);
    }
    CHECK(gdaki_commit_thread_exclusive(h) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);

    /* Device-function errors are codes, the QP untouched. */
    CHECK(gdaki_put_thread_exclusive(h, d.addr, d.rkey, s.addr, s.lkey, 64, 0x80, NULL) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_put_inline_thread_exclusive(h, d.addr, d.rkey, NULL, 8, 0, NULL) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_put_thread_exclusive(NULL, d.addr, d.rkey, s.addr, s.lkey, 64, 0, NULL) == GDAKI_CODE_BAD_HANDLE);
    gdaki_qp_info info;
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RTS);

    /* A wrong rkey: an error completion, and the QP in error with the syndrome. */
    CHECK(gdaki_put_thread_exclusive(h, d.addr, d.rkey ^ 0x5a5a00, s.addr, s.lkey, 64, 0, &ticket) == GDAKI_OK);
    uint32_t code = gdaki_wait_thread_exclusive(h, ticket);
    CHECK((code & ~0xffu) == GDAKI_CODE_CQE_ERROR);
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_ERROR && info.syndrome == (code & 0xff));

    /* Reset after the error, connected again: the same handle posts on. */
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_qp_reset(NULL));
    OK(gdaki_qp_reset(qp));
    OK(gdaki_qp_query(qp, &info));
    CHECK(info.state == GDAKI_QP_STATE_RESET);
    gdaki_endpoint again;
    OK(gdaki_qp_endpoint(qp, &again));
    OK(gdaki_qp_connect(qp, &again));
    CHECK(gdaki_put_inline_thread_exclusive(h, d.addr + 32, d.rkey, word, sizeof word, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    OK(gdaki_region_read(dst, 32, back, sizeof back));
    CHECK(memcmp(back, word, sizeof word) == 0);

    /* A counter: a cross-channel companion adds to a word once the put it waits for is done. */
    {
        gdaki_qp_config cc;
        OK(gdaki_qp_config_init(&cc));
        CHECK(cc.cross_channel == 0);
        cc.sq_size = 64;
        cc.cross_channel = 2;
        gdaki_cq *ccq = NULL;
        OK(gdaki_cq_create(ctx, 64, NULL, &ccq));
        gdaki_qp *comp = NULL;
        EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, ccq, &cc, &comp));
        cc.cross_channel = 1;
        OK(gdaki_qp_create(ctx, ccq, &cc, &comp));
        gdaki_endpoint ce;
        OK(gdaki_qp_endpoint(comp, &ce));
        OK(gdaki_qp_connect(comp, &ce));
        gdaki_dev_qp *ch = NULL;
        OK(gdaki_qp_host_handle(comp, &ch));
        uint64_t zero8 = 0, counted = 0, now8 = 0;
        OK(gdaki_region_write(dst, 4096 + 64, &zero8, sizeof zero8));
        CHECK(gdaki_put_inline_thread_exclusive(h, d.addr + 48, d.rkey, word, sizeof word, 0, &ticket) == GDAKI_OK);
        CHECK(gdaki_count_when_done_thread_exclusive(ch, h, ticket, d.addr + 4096 + 64, d.rkey, 7, s.addr + 8192,
                                                     s.lkey, 0, &counted) == GDAKI_OK);
        CHECK(gdaki_count_when_done_thread_exclusive(ch, NULL, ticket, d.addr + 4096 + 64, d.rkey, 7, s.addr + 8192,
                                                     s.lkey, 0, NULL) == GDAKI_CODE_BAD_HANDLE);
        CHECK(gdaki_wait_thread_exclusive(ch, counted) == GDAKI_OK);
        OK(gdaki_region_read(dst, 4096 + 64, &now8, sizeof now8));
        CHECK(now8 == 7);
        OK(gdaki_qp_destroy(comp));
        OK(gdaki_cq_destroy(ccq));
    }

    /* A reliable doorbell: the soft HCA takes one; posts ring with the doorbell alone. */
    {
        uint8_t supported = 9;
        EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_context_supports_reliable_doorbell(ctx, NULL));
        OK(gdaki_context_supports_reliable_doorbell(ctx, &supported));
        CHECK(supported == 1);
        gdaki_qp_config rc;
        OK(gdaki_qp_config_init(&rc));
        CHECK(rc.reliable_doorbell == 0);
        rc.sq_size = 64;
        rc.reliable_doorbell = 2;
        gdaki_cq *rcq = NULL;
        OK(gdaki_cq_create(ctx, 64, NULL, &rcq));
        gdaki_qp *rqp = NULL;
        EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, rcq, &rc, &rqp));
        rc.reliable_doorbell = 1;
        OK(gdaki_qp_create(ctx, rcq, &rc, &rqp));
        gdaki_endpoint re;
        OK(gdaki_qp_endpoint(rqp, &re));
        OK(gdaki_qp_connect(rqp, &re));
        gdaki_dev_qp *rh = NULL;
        OK(gdaki_qp_host_handle(rqp, &rh));
        CHECK(gdaki_put_inline_thread_exclusive(rh, d.addr + 64, d.rkey, word, sizeof word, 0, &ticket) == GDAKI_OK);
        CHECK(gdaki_wait_thread_exclusive(rh, ticket) == GDAKI_OK);
        OK(gdaki_region_read(dst, 64, back, sizeof back));
        CHECK(memcmp(back, word, sizeof word) == 0);
        OK(gdaki_qp_destroy(rqp));
        OK(gdaki_cq_destroy(rcq));
    }

    /* A second protection domain: its region's key is refused by a QP of the first. */
    gdaki_context *tenant = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_context_alloc_pd(ctx, NULL));
    OK(gdaki_context_alloc_pd(ctx, &tenant));
    gdaki_region *theirs = NULL;
    OK(gdaki_region_alloc(tenant, 4096, GDAKI_ACCESS_ALL, &theirs));
    OK(gdaki_context_destroy(tenant)); /* the region keeps its domain */
    gdaki_region_info t;
    OK(gdaki_region_query(theirs, &t));
    gdaki_cq *cq2 = NULL;
    gdaki_qp *qp2 = loopback(&cq2, GDAKI_DOORBELL_GPU);
    gdaki_dev_qp *h2 = NULL;
    OK(gdaki_qp_host_handle(qp2, &h2));
    CHECK(gdaki_put_thread_exclusive(h2, t.addr, t.rkey, s.addr, s.lkey, 64, 0, &ticket) == GDAKI_OK);
    code = gdaki_wait_thread_exclusive(h2, ticket);
    CHECK((code & ~0xffu) == GDAKI_CODE_CQE_ERROR);
    OK(gdaki_region_destroy(theirs));
    OK(gdaki_qp_destroy(qp2));
    OK(gdaki_cq_destroy(cq2));

    OK(gdaki_region_destroy(src));
    OK(gdaki_region_destroy(dst));
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_cq_destroy(cq));
}

/* Two-sided verbs from C on the host: a loopback QP with a receive queue, receives posted and
 * polled through gdaki_device.h's receive functions, SENDs through the thread-scope ones. */
static void two_sided(void) {
    gdaki_qp_config cfg;
    OK(gdaki_qp_config_init(&cfg));
    CHECK(cfg.rq_size == 0 && cfg.rq_max_bufs == 1 && cfg.rnr_retry == 7 && cfg.min_rnr_timer == 12);
    cfg.sq_size = 64;
    cfg.timeout_ms = 5000;
    cfg.retry_timeout_ms = 1000;
    gdaki_cq *cq = NULL;
    gdaki_qp *qp = NULL;
    OK(gdaki_cq_create(ctx, 64, NULL, &cq));
    cfg.rq_max_bufs = 5;
    cfg.rq_size = 16;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_qp_create(ctx, cq, &cfg, &qp));
    LAST_ERROR_HAS("max_bufs");
    cfg.rq_max_bufs = 1;
    OK(gdaki_qp_create(ctx, cq, &cfg, &qp));
    gdaki_endpoint self;
    OK(gdaki_qp_endpoint(qp, &self));
    OK(gdaki_qp_connect(qp, &self));
    gdaki_dev_qp *h = NULL;
    gdaki_dev_rq *rq = NULL;
    OK(gdaki_qp_host_handle(qp, &h));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_qp_host_receive_handle(qp, NULL));
    OK(gdaki_qp_host_receive_handle(qp, &rq));
    CHECK(rq != NULL && rq->version == GDAKI_DEV_RQ_VERSION && rq->qpn == h->qpn);

    gdaki_region *mr = NULL;
    OK(gdaki_region_alloc(ctx, 65536, GDAKI_ACCESS_ALL, &mr));
    gdaki_region_info m;
    OK(gdaki_region_query(mr, &m));
    const char hello[] = "hello, receiver";
    OK(gdaki_region_write(mr, 0, hello, sizeof hello));
    uint64_t r0 = 9, r1 = 9, ticket = 0;
    CHECK(gdaki_post_recv_exclusive(rq, m.addr + 4096, m.lkey, 256, &r0) == GDAKI_OK && r0 == 0);
    CHECK(gdaki_post_recv_exclusive(rq, m.addr + 8192, m.lkey, 256, &r1) == GDAKI_OK && r1 == 1);
    CHECK(gdaki_send_imm_thread_exclusive(h, m.addr, m.lkey, sizeof hello, 0x1234, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_send_inline_thread_exclusive(h, "tiny", 4, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    uint32_t bytes = 0, kind = 9, imm = 0;
    CHECK(gdaki_poll_recv_exclusive(rq, r0, &bytes, &kind, &imm) == GDAKI_OK);
    CHECK(bytes == sizeof hello && kind == GDAKI_RECV_SEND_IMM && imm == 0x1234);
    CHECK(gdaki_poll_recv_exclusive(rq, r1, &bytes, &kind, NULL) == GDAKI_OK);
    CHECK(bytes == 4 && kind == GDAKI_RECV_SEND);
    char got[sizeof hello];
    OK(gdaki_region_read(mr, 4096, got, sizeof got));
    CHECK(memcmp(got, hello, sizeof hello) == 0);
    OK(gdaki_region_read(mr, 8192, got, 4));
    CHECK(memcmp(got, "tiny", 4) == 0);
    /* Refusals are codes: no handle, inline data too long. */
    CHECK(gdaki_post_recv_exclusive(NULL, m.addr, m.lkey, 8, NULL) == GDAKI_CODE_BAD_HANDLE);
    char big[GDAKI_MAX_SEND_INLINE + 1] = {0};
    CHECK(gdaki_send_inline_thread_exclusive(h, big, sizeof big, 0, NULL) == GDAKI_CODE_INLINE_TOO_LONG);
    /* A batch of three receives behind one record update; arrival seen without consuming. */
    uint64_t addrs[3] = {m.addr + 16384, m.addr + 16384 + 256, m.addr + 16384 + 512};
    uint64_t first = 0;
    uint32_t arrived = 9;
    CHECK(gdaki_post_recvs_exclusive(rq, 3, addrs, m.lkey, 256, &first) == GDAKI_OK && first == 2);
    CHECK(gdaki_recv_arrived_exclusive(rq, first, &arrived) == GDAKI_OK && arrived == 0);
    for (int i = 0; i < 3; i++) {
        CHECK(gdaki_send_inline_thread_exclusive(h, "abc", 3, 0, &ticket) == GDAKI_OK);
    }
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    CHECK(gdaki_recv_arrived_exclusive(rq, first + 2, &arrived) == GDAKI_OK && arrived == 1);
    CHECK(gdaki_wait_recv_arrived_exclusive(rq, first + 2) == GDAKI_OK);
    for (uint64_t i = 0; i < 3; i++) {
        bytes = 0;
        CHECK(gdaki_poll_recv_exclusive(rq, first + i, &bytes, NULL, NULL) == GDAKI_OK && bytes == 3);
    }
    OK(gdaki_region_read(mr, 16384 + 512, got, 3));
    CHECK(memcmp(got, "abc", 3) == 0);
    /* Refused whole: more than the queue holds, no addresses, a buffer too long, no handle. */
    CHECK(gdaki_post_recvs_exclusive(rq, 17, addrs, m.lkey, 256, NULL) == GDAKI_CODE_BAD_COUNT);
    CHECK(gdaki_post_recvs_exclusive(rq, 3, NULL, m.lkey, 256, NULL) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_post_recvs_exclusive(rq, 3, addrs, m.lkey, 0x80000000u, NULL) == GDAKI_CODE_TOO_LONG);
    CHECK(gdaki_recv_arrived_exclusive(NULL, 0, &arrived) == GDAKI_CODE_BAD_HANDLE);
    CHECK(gdaki_wait_recv_arrived_exclusive(NULL, 0) == GDAKI_CODE_BAD_HANDLE);
    /* A receive too small: the SEND completes in error, so does the receive. */
    uint64_t small = 0;
    CHECK(gdaki_post_recv_exclusive(rq, m.addr + 12288, m.lkey, 2, &small) == GDAKI_OK && small == 5);
    CHECK(gdaki_send_inline_thread_exclusive(h, "toolong", 7, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == (GDAKI_CODE_CQE_ERROR | 0x12)); /* remote invalid request */
    CHECK(gdaki_poll_recv_exclusive(rq, small, NULL, NULL, NULL) == (GDAKI_CODE_CQE_ERROR | 0x01)); /* local length */
    OK(gdaki_region_destroy(mr));
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_cq_destroy(cq));

    /* A QP without a receive queue has no receive handle. */
    qp = loopback(&cq, GDAKI_DOORBELL_GPU);
    EXPECT(GDAKI_STATUS_UNSUPPORTED, gdaki_qp_host_receive_handle(qp, &rq));
    LAST_ERROR_HAS("rq_size");
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_cq_destroy(cq));
}

/* Stream-triggered posting on a CPU stream: a flag gates the doorbell, a wait for the
 * completion, a flag after it; a batch with inline data; the window's GDAKI_STATUS_AGAIN; a
 * recording launched many times; and the refusals. */
static void streams(void) {
    gdaki_cq *cq = NULL;
    gdaki_qp *qp = loopback(&cq, GDAKI_DOORBELL_GPU);
    gdaki_region *mr = NULL;
    OK(gdaki_region_alloc(ctx, 65536, GDAKI_ACCESS_ALL, &mr));
    gdaki_region_info r;
    OK(gdaki_region_query(mr, &r));
    static unsigned char data[4096];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 13 + 1);
    OK(gdaki_region_write(mr, 0, data, sizeof data));

    gdaki_stream *st = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_cpu(0, &st));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_stream_cpu(1000, NULL));
    OK(gdaki_stream_cpu(5000, &st));
    gdaki_stream_qp *sq = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_stream_qp_create(NULL, NULL, &sq));
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_stream_qp_create((const gdaki_qp *)mr, NULL, &sq));
    OK(gdaki_stream_qp_create(qp, NULL, &sq));

    /* The stream waits for the gate, then rings; the CPU posted long before. */
    static volatile uint32_t flags[4];
    gdaki_work_request wr = {.opcode = GDAKI_WR_PUT, .len = 4096, .local_addr = r.addr, .lkey = r.lkey,
                             .remote_addr = r.addr + 8192, .rkey = r.rkey};
    uint64_t ticket = 99;
    OK(gdaki_stream_wait_value32(st, (uint64_t)(uintptr_t)&flags[0], 1, GDAKI_WAIT_EQ));
    OK(gdaki_stream_qp_post(sq, st, &wr, 1, &ticket));
    CHECK(ticket == 0);
    OK(gdaki_stream_qp_wait(sq, st, ticket));
    OK(gdaki_stream_write_value32(st, (uint64_t)(uintptr_t)&flags[1], 7));
    EXPECT(GDAKI_STATUS_TIMEOUT, gdaki_stream_synchronize(st, 50));
    uint32_t done = 9;
    OK(gdaki_stream_qp_completed(sq, ticket, &done));
    CHECK(done == 0 && flags[1] == 0);
    flags[0] = 1;
    OK(gdaki_stream_synchronize(st, 5000));
    OK(gdaki_stream_qp_completed(sq, ticket, &done));
    CHECK(done == 1 && flags[1] == 7);
    static unsigned char got[4096];
    OK(gdaki_region_read(mr, 8192, got, sizeof got));
    CHECK(memcmp(got, data, sizeof got) == 0);

    /* A batch of three under one doorbell, one of them inline. */
    const char word[] = "stream!";
    gdaki_work_request batch[3] = {
        {.opcode = GDAKI_WR_PUT, .len = 64, .local_addr = r.addr, .lkey = r.lkey, .remote_addr = r.addr + 16384,
         .rkey = r.rkey},
        {.opcode = GDAKI_WR_PUT_INLINE, .len = sizeof word, .remote_addr = r.addr + 20480, .rkey = r.rkey,
         .inline_data = word},
        {.opcode = GDAKI_WR_GET, .len = 64, .local_addr = r.addr + 24576, .lkey = r.lkey, .remote_addr = r.addr,
         .rkey = r.rkey},
    };
    OK(gdaki_stream_qp_post(sq, st, batch, 3, &ticket));
    CHECK(ticket == 1);
    OK(gdaki_stream_qp_wait(sq, st, 3));
    OK(gdaki_stream_synchronize(st, 5000));
    char back[sizeof word];
    OK(gdaki_region_read(mr, 20480, back, sizeof back));
    CHECK(memcmp(back, word, sizeof word) == 0);
    OK(gdaki_region_read(mr, 24576, got, 64));
    CHECK(memcmp(got, data, 64) == 0);

    /* Refusals: a wait for a WQE not posted, bad opcodes and conditions, a wrong handle. */
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_qp_wait(sq, st, 4));
    LAST_ERROR_HAS("would never end");
    gdaki_work_request bad = wr;
    bad.opcode = 42;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_qp_post(sq, st, &bad, 1, &ticket));
    LAST_ERROR_HAS("opcode 42");
    bad = wr;
    bad.reserved = 1;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_qp_post(sq, st, &bad, 1, &ticket));
    bad = batch[1];
    bad.inline_data = NULL;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_stream_qp_post(sq, st, &bad, 1, &ticket));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_wait_value32(st, (uint64_t)(uintptr_t)&flags[0], 1, 9));
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_stream_qp_post((const gdaki_stream_qp *)st, st, &wr, 1, &ticket));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_stream_qp_wait_recv(sq, st, 0));

    /* The window: with the stream held at a gate, 64 WQEs fill the send queue, the next is AGAIN. */
    OK(gdaki_stream_wait_value32(st, (uint64_t)(uintptr_t)&flags[2], 1, GDAKI_WAIT_EQ));
    gdaki_work_request many[64];
    for (int i = 0; i < 64; i++) many[i] = batch[0];
    OK(gdaki_stream_qp_post(sq, st, many, 64, &ticket));
    EXPECT(GDAKI_STATUS_AGAIN, gdaki_stream_qp_post(sq, st, &wr, 1, &ticket));
    LAST_ERROR_HAS("send queue is full");
    flags[2] = 1;
    OK(gdaki_stream_qp_wait(sq, st, ticket + 63));
    OK(gdaki_stream_synchronize(st, 5000));

    /* A recording of 8 put+wait pairs, launched 20 times, each launch's bytes checked. */
    gdaki_replay *replay = NULL;
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_stream_end_recording(st, &replay));
    LAST_ERROR_HAS("not recording");
    OK(gdaki_stream_begin_recording(st));
    for (int i = 0; i < 8; i++) {
        gdaki_work_request p = {.opcode = GDAKI_WR_PUT, .len = 512, .local_addr = r.addr + i * 512, .lkey = r.lkey,
                                .remote_addr = r.addr + 32768 + i * 512, .rkey = r.rkey};
        OK(gdaki_stream_qp_post(sq, st, &p, 1, &ticket));
        OK(gdaki_stream_qp_wait(sq, st, ticket));
    }
    OK(gdaki_stream_end_recording(st, &replay));
    const gdaki_stream_qp *qps[2] = {sq, sq};
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_replay_launch(replay, qps, 2, NULL));
    LAST_ERROR_HAS("twice");
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_replay_launch(replay, qps, 0, NULL));
    int launched_ok = 1;
    for (int launch = 0; launch < 20; launch++) {
        for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 5 + launch);
        OK(gdaki_region_write(mr, 0, data, sizeof data));
        uint64_t first = 0;
        OK(gdaki_replay_launch(replay, qps, 1, &first));
        OK(gdaki_stream_synchronize(st, 5000));
        OK(gdaki_stream_qp_completed(sq, first + 7, &done));
        OK(gdaki_region_read(mr, 32768, got, sizeof got));
        launched_ok &= done == 1 && memcmp(got, data, sizeof got) == 0;
    }
    CHECK(launched_ok);
    OK(gdaki_replay_destroy(replay));
    OK(gdaki_replay_destroy(NULL));

    /* Handles go in any order: the stream queue pair keeps the queue pair alive. */
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_cq_destroy(cq));
    OK(gdaki_stream_qp_destroy(sq));
    OK(gdaki_stream_destroy(st));
    OK(gdaki_stream_destroy(NULL));
    OK(gdaki_region_destroy(mr));
}

/* Sockets between two threads of this program (a listener, a client), as two CPU peers talk:
 * echo, a stream longer than the ring, non-blocking calls, half close, reset, refusals. */
struct echo_server {
    gdaki_socket_listener *listener;
    int ok;
};

static void *socket_echo_server(void *arg) {
    struct echo_server *e = arg;
    gdaki_socket *s = NULL;
    if (gdaki_socket_accept(e->listener, 10000, &s) != GDAKI_STATUS_OK) return NULL;
    static char buf[3000];
    size_t n = 0;
    e->ok = 1;
    for (;;) {
        if (gdaki_socket_recv(s, buf, sizeof buf, 0, &n) != GDAKI_STATUS_OK) {
            e->ok = 0;
            break;
        }
        if (n == 0) break;
        size_t at = 0, sent = 0;
        while (at < n) {
            if (gdaki_socket_send(s, buf + at, n - at, 0, &sent) != GDAKI_STATUS_OK) {
                e->ok = 0;
                break;
            }
            at += sent;
        }
    }
    e->ok &= gdaki_socket_shutdown(s) == GDAKI_STATUS_OK;
    e->ok &= gdaki_socket_flush(s) == GDAKI_STATUS_OK;
    gdaki_socket_destroy(s);
    return NULL;
}

static void sockets(void) {
    gdaki_socket_config cfg;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_config_init(NULL));
    OK(gdaki_socket_config_init(&cfg));
    CHECK(cfg.rx_bytes == 65536 && cfg.memory == GDAKI_SOCKET_MEMORY_HOST);
    cfg.rx_bytes = 4096;
    cfg.timeout_ms = 30000; /* valgrind slows the soft HCA's thread many times over */
    gdaki_socket_listener *l = NULL;
    gdaki_socket_config bad = cfg;
    bad.rx_bytes = 5000;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_listen(ctx, "127.0.0.1:0", &bad, &l));
    bad = cfg;
    bad.memory = GDAKI_SOCKET_MEMORY_DEVICE;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_listen(ctx, "127.0.0.1:0", &bad, &l));
    LAST_ERROR_HAS("config.gpu is NULL");
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_listen(ctx, "nowhere", &cfg, &l));
    OK(gdaki_socket_listen(ctx, "127.0.0.1:0", &cfg, &l));
    uint16_t port = 0;
    OK(gdaki_socket_listener_port(l, &port));
    CHECK(port != 0);
    EXPECT(GDAKI_STATUS_TIMEOUT, gdaki_socket_accept(l, 50, &(gdaki_socket *){NULL}));

    struct echo_server e = {l, 0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, socket_echo_server, &e) == 0);
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)port);
    gdaki_socket *c = NULL;
    OK(gdaki_socket_connect(ctx, addr, &cfg, &c));
    /* 20000 bytes through a 4 KiB ring, sent and read back in turns. */
    static unsigned char out[20000], back[20000];
    for (size_t i = 0; i < sizeof out; i++) out[i] = (unsigned char)(i * 31 + 7);
    size_t sent_total = 0, got_total = 0, n = 0;
    /* Bounded (the echo thread may fail), and napping when neither side can move, so a
     * slowed-down run (valgrind serialises the threads) lets the echo thread in. */
    time_t give_up = time(NULL) + 120;
    while (got_total < sizeof out && time(NULL) < give_up) {
        int moved = 0;
        if (sent_total < sizeof out) {
            gdaki_status st = gdaki_socket_send(c, out + sent_total, sizeof out - sent_total, GDAKI_SOCKET_NONBLOCK, &n);
            if (st == GDAKI_STATUS_OK) sent_total += n, moved = 1;
            else if (st != GDAKI_STATUS_AGAIN) break;
        }
        gdaki_status st = gdaki_socket_recv(c, back + got_total, sizeof back - got_total, GDAKI_SOCKET_NONBLOCK, &n);
        if (st == GDAKI_STATUS_OK) got_total += n, moved = 1;
        else if (st != GDAKI_STATUS_AGAIN) break;
        if (!moved) nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    CHECK(got_total == sizeof out && memcmp(back, out, sizeof out) == 0);
    /* Sends from a registered region, without the copy: the echo comes back the same; bytes
     * the region does not hold are refused and nothing is sent. */
    gdaki_region *src = NULL;
    OK(gdaki_region_alloc(ctx, 3000, GDAKI_ACCESS_ALL, &src));
    OK(gdaki_region_write(src, 0, out, 3000));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_send_from(c, src, 2000, 1001, 0, &n));
    LAST_ERROR_HAS("region");
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_send_from(c, NULL, 0, 1, 0, &n));
    size_t from = 0;
    got_total = 0;
    give_up = time(NULL) + 120;
    while (got_total < 3000 && time(NULL) < give_up) {
        if (from < 3000) {
            OK(gdaki_socket_send_from(c, src, from, 3000 - from, 0, &n));
            from += n;
        }
        OK(gdaki_socket_recv(c, back + got_total, 3000 - got_total, 0, &n));
        got_total += n;
    }
    CHECK(got_total == 3000 && memcmp(back, out, 3000) == 0);
    OK(gdaki_socket_flush(c));
    OK(gdaki_region_destroy(src));
    /* Handing a socket to a GPU: refusals leave it as it was (rings in host memory are out of
     * every GPU's reach). */
    gdaki_gpu_socket *gs = NULL;
    gdaki_socket *cs = c;
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_export_gpu(&cs, NULL, &gs));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_export_gpu(NULL, NULL, &gs));
    gdaki_gpu *gpu = NULL;
    if (gdaki_gpu_open(0, &gpu) == GDAKI_STATUS_OK) {
        EXPECT(GDAKI_STATUS_UNSUPPORTED, gdaki_socket_export_gpu(&cs, gpu, &gs));
        LAST_ERROR_HAS("does not reach");
        OK(gdaki_gpu_destroy(gpu));
    }
    CHECK(cs == c && gs == NULL);
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_gpu_socket_handle(NULL, &(gdaki_dev_socket *){NULL}));
    OK(gdaki_gpu_socket_destroy(NULL));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_send(c, out, 1, 8, &n));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_send(c, NULL, 1, 0, &n));
    OK(gdaki_socket_shutdown(c));
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_socket_send(c, out, 1, 0, &n));
    OK(gdaki_socket_recv(c, back, sizeof back, 0, &n));
    CHECK(n == 0); /* the server's end of stream */
    pthread_join(t, NULL);
    CHECK(e.ok);
    OK(gdaki_socket_destroy(c));

    /* A reset is seen by the peer. */
    e.ok = 0;
    CHECK(pthread_create(&t, NULL, socket_echo_server, &e) == 0);
    OK(gdaki_socket_connect(ctx, addr, &cfg, &c));
    OK(gdaki_socket_reset(c));
    pthread_join(t, NULL);
    CHECK(!e.ok); /* its recv failed */
    EXPECT(GDAKI_STATUS_PEER, gdaki_socket_send(c, out, 1, 0, &n));
    LAST_ERROR_HAS("reset");
    OK(gdaki_socket_destroy(c));
    EXPECT(GDAKI_STATUS_BAD_HANDLE, gdaki_socket_send((const gdaki_socket *)l, out, 1, 0, &n));
    OK(gdaki_socket_listener_destroy(l));
    OK(gdaki_socket_destroy(NULL));
    OK(gdaki_socket_listener_destroy(NULL));
}

/* A CPU client of a socket the service below accepts: sends a greeting, checks its echo,
 * shuts down, expects the end of stream. */
static void *service_client(void *arg) {
    const char *addr = arg;
    gdaki_socket_config cfg;
    gdaki_socket_config_init(&cfg);
    cfg.rx_bytes = 4096;
    cfg.timeout_ms = 30000;
    gdaki_socket *c = NULL;
    if (gdaki_socket_connect(ctx, addr, &cfg, &c) != GDAKI_STATUS_OK) return NULL;
    static const char hello[] = "hello, socket service";
    char back[sizeof hello];
    size_t n = 0, got = 0;
    int ok = gdaki_socket_send(c, hello, sizeof hello, 0, &n) == GDAKI_STATUS_OK && n == sizeof hello;
    while (ok && got < sizeof back) {
        ok = gdaki_socket_recv(c, back + got, sizeof back - got, 0, &n) == GDAKI_STATUS_OK && n > 0;
        got += n;
    }
    ok = ok && memcmp(back, hello, sizeof hello) == 0 && gdaki_socket_shutdown(c) == GDAKI_STATUS_OK;
    ok = ok && gdaki_socket_recv(c, back, sizeof back, 0, &n) == GDAKI_STATUS_OK && n == 0;
    gdaki_socket_destroy(c);
    return ok ? (void *)1 : NULL;
}

/* The socket service in CPU mode: this thread plays a kernel that listens, accepts and echoes
 * through the device functions (thread scope, the gpu mode of the service's sockets), and a
 * C host socket connects to it. */
static void socket_service(void) {
    gdaki_socket_config cfg;
    OK(gdaki_socket_config_init(&cfg));
    cfg.rx_bytes = 4096;
    cfg.timeout_ms = 30000;
    gdaki_socket_service *svc = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_socket_service_start(ctx, "nowhere", &cfg, &svc));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_service_start(ctx, NULL, &cfg, &svc));
    OK(gdaki_socket_service_start(ctx, "127.0.0.1", &cfg, &svc));
    const gdaki_dev_socket_service *h = NULL;
    OK(gdaki_socket_service_handle(svc, &h));
    CHECK(h != NULL);
    uint32_t port = 0;
    CHECK(gdaki_socket_listen_thread(h, 0, &port) == GDAKI_OK && port != 0);
    CHECK(gdaki_socket_listen_thread(h, port, NULL) == GDAKI_CODE_REFUSED);
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)port);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, service_client, addr) == 0);
    gdaki_dev_socket *s = NULL;
    CHECK(gdaki_socket_accept_thread(h, port, &s) == GDAKI_OK && s != NULL);
    char buf[64];
    uint64_t n = 0;
    /* The greeting's first bytes read in place: a peek says where they landed, a count past
     * them is refused (consuming nothing), then they are consumed. */
    uint64_t at = 0, len = 0;
    CHECK(gdaki_socket_peek_thread_gpu(s, sizeof buf, &at, &len) == GDAKI_OK && len > 0 && at != 0);
    CHECK(gdaki_socket_consume_thread_gpu(s, len + 1) == GDAKI_CODE_BAD_ARGUMENT);
    memcpy(buf, (const void *)(uintptr_t)at, (size_t)len);
    CHECK(gdaki_socket_consume_thread_gpu(s, len) == GDAKI_OK);
    n = len;
    CHECK(gdaki_socket_send_all_thread_gpu(s, buf, n) == GDAKI_OK);
    /* The rest of the greeting, if it came in pieces, then its end. */
    while (n > 0) {
        CHECK(gdaki_socket_recv_thread_gpu(s, buf, sizeof buf, &n) == GDAKI_OK);
        if (n > 0) CHECK(gdaki_socket_send_all_thread_gpu(s, buf, n) == GDAKI_OK);
    }
    CHECK(gdaki_socket_close_thread_gpu(s) == GDAKI_OK);
    CHECK(gdaki_socket_release_thread(h, s) == GDAKI_OK);
    void *client_ok = NULL;
    pthread_join(t, &client_ok);
    CHECK(client_ok != NULL);
    /* Refusals. */
    CHECK(gdaki_socket_release_thread(h, s) == GDAKI_CODE_BAD_HANDLE);
    CHECK(gdaki_socket_release_thread(h, NULL) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_socket_connect_thread(h, NULL, &s) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_socket_connect_thread(h, "no such host:1", &s) == GDAKI_CODE_REFUSED);
    CHECK(gdaki_socket_accept_thread(h, 1, &s) == GDAKI_CODE_REFUSED);
    CHECK(gdaki_socket_listen_thread(h, 70000, NULL) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_socket_unlisten_thread(h, port) == GDAKI_OK);
    CHECK(gdaki_socket_unlisten_thread(h, port) == GDAKI_CODE_BAD_ARGUMENT);
    CHECK(gdaki_socket_connect_thread(NULL, addr, &s) == GDAKI_CODE_BAD_HANDLE);
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_service_handle(NULL, &h));
    uint32_t freed = 99;
    OK(gdaki_socket_service_reap(svc, &freed));
    CHECK(freed == 0); /* CPU-mode sockets are freed at their release */
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_socket_service_reap(NULL, &freed));
    OK(gdaki_socket_service_destroy(svc));
    OK(gdaki_socket_service_destroy(NULL));
}

static void proxy(void) {
    gdaki_proxy *p = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_proxy_start(0, &p));
    OK(gdaki_proxy_start(1, &p));
    gdaki_cq *cq = NULL, *cq2 = NULL;
    gdaki_qp *qp = loopback(&cq, GDAKI_DOORBELL_CPU_PROXY);
    gdaki_qp *rung_by_poster = loopback(&cq2, GDAKI_DOORBELL_GPU);
    /* With rings in host memory the proxy writes the record: not CPU-assisted. */
    gdaki_qp_info qi;
    OK(gdaki_qp_query(qp, &qi));
    CHECK(qi.doorbell == GDAKI_DOORBELL_CPU_PROXY && qi.rings_in_gpu_memory == 0);
    /* Asking for CPU-assisted asks for the proxy; host rings make it the plain proxy. */
    gdaki_cq *cq3 = NULL;
    gdaki_qp *assisted = loopback(&cq3, GDAKI_DOORBELL_CPU_ASSISTED);
    OK(gdaki_qp_query(assisted, &qi));
    CHECK(qi.doorbell == GDAKI_DOORBELL_CPU_PROXY);
    OK(gdaki_qp_destroy(assisted));
    OK(gdaki_cq_destroy(cq3));
    uint64_t id = 0;
    EXPECT(GDAKI_STATUS_INVALID_STATE, gdaki_proxy_add(p, rung_by_poster, &id));
    OK(gdaki_proxy_add(p, qp, &id));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_proxy_remove(p, id + 100));

    gdaki_region *r = NULL;
    OK(gdaki_region_alloc(ctx, 4096, GDAKI_ACCESS_ALL, &r));
    gdaki_region_info ri;
    OK(gdaki_region_query(r, &ri));
    uint64_t one = 0x1122334455667788ull, ticket = 0;
    OK(gdaki_region_write(r, 0, &one, sizeof one));
    gdaki_dev_qp *h = NULL;
    OK(gdaki_qp_host_handle(qp, &h));
    CHECK(gdaki_put_thread_exclusive(h, ri.addr + 64, ri.rkey, ri.addr, ri.lkey, 8, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    uint64_t copied = 0;
    OK(gdaki_region_read(r, 64, &copied, sizeof copied));
    CHECK(copied == one);

    OK(gdaki_proxy_remove(p, id));
    OK(gdaki_proxy_destroy(p));
    OK(gdaki_region_destroy(r));
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_qp_destroy(rung_by_poster));
    OK(gdaki_cq_destroy(cq));
    OK(gdaki_cq_destroy(cq2));
}

/* ---------------------------------------------------------------- handshake: two threads */

static char server_addr[64];

static void nap_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* A free TCP port on 127.0.0.1 (the kernel's choice; closed again, so another process could
 * take it in between, which the test would then report). */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(fd, (struct sockaddr *)&a, &n) != 0) {
        perror("free_port");
        exit(2);
    }
    close(fd);
    return ntohs(a.sin_port);
}

struct side {
    int refuse;
    gdaki_region *region;
    gdaki_qp *qp;
    gdaki_cq *cq;
    gdaki_remote_region peer_region;
};

static void *server(void *arg) {
    struct side *me = arg;
    gdaki_channel *ch = NULL;
    OK(gdaki_channel_accept(server_addr, 5000, &ch));
    uint8_t app[8];
    gdaki_endpoint eps[1];
    gdaki_remote_region regions[1];
    if (me->refuse) {
        /* Read the hello first, as a server does before judging it (and so that closing does
         * not reset the connection over unread bytes). */
        gdaki_hello all = {app, 0, sizeof app, eps, 0, 1, regions, 0, 1};
        OK(gdaki_channel_receive(ch, &all));
        OK(gdaki_channel_reject(ch, "wrong size: the server runs 8 bytes"));
        OK(gdaki_channel_destroy(ch));
        return NULL;
    }
    /* Too little room first: told what is needed, nothing lost. */
    gdaki_hello in = {app, 0, 2, eps, 0, 1, regions, 0, 1};
    EXPECT(GDAKI_STATUS_BUFFER_TOO_SMALL, gdaki_channel_receive(ch, &in));
    CHECK(in.app_len == 6 && in.endpoints_len == 1 && in.regions_len == 1);
    in.app_cap = sizeof app;
    OK(gdaki_channel_receive(ch, &in));
    CHECK(in.app_len == 6 && memcmp(app, "size=8", 6) == 0);
    OK(gdaki_qp_connect(me->qp, &eps[0]));
    me->peer_region = regions[0];

    gdaki_endpoint mine;
    gdaki_remote_region mine_r;
    OK(gdaki_qp_endpoint(me->qp, &mine));
    OK(gdaki_region_remote(me->region, &mine_r));
    gdaki_hello out = {(uint8_t *)"size=8", 6, 0, &mine, 1, 0, &mine_r, 1, 0};
    OK(gdaki_channel_send(ch, &out));
    OK(gdaki_channel_sync(ch, 1)); /* both connected */
    OK(gdaki_channel_sync(ch, 2)); /* the client has written */
    uint64_t got = 0;
    OK(gdaki_region_read(me->region, 0, &got, sizeof got));
    CHECK(got == 0xfeedfacecafebeefull);
    EXPECT(GDAKI_STATUS_PEER, gdaki_channel_sync(ch, 99)); /* the client is at step 3 */
    OK(gdaki_channel_destroy(ch));
    return NULL;
}

static void side_init(struct side *s) {
    memset(s, 0, sizeof *s);
    gdaki_qp_config cfg;
    OK(gdaki_qp_config_init(&cfg));
    cfg.sq_size = 16;
    OK(gdaki_cq_create(ctx, 16, NULL, &s->cq));
    OK(gdaki_qp_create(ctx, s->cq, &cfg, &s->qp));
    OK(gdaki_region_alloc(ctx, 4096, GDAKI_ACCESS_ALL, &s->region));
}

static void side_fini(struct side *s) {
    OK(gdaki_qp_destroy(s->qp));
    OK(gdaki_cq_destroy(s->cq));
    OK(gdaki_region_destroy(s->region));
}

static void handshake(void) {
    gdaki_channel *ch = NULL;
    snprintf(server_addr, sizeof server_addr, "127.0.0.1:%d", free_port());
    /* Nobody listening: refused at once. */
    EXPECT(GDAKI_STATUS_PEER, gdaki_channel_connect(server_addr, 1000, &ch));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_channel_connect("localhost", 1000, &ch));
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_channel_connect(server_addr, 0, &ch));
    /* Nobody connecting: a timeout. */
    EXPECT(GDAKI_STATUS_TIMEOUT, gdaki_channel_accept(server_addr, 200, &ch));
    CHECK(ch == NULL);

    struct side srv, cli;
    side_init(&srv);
    side_init(&cli);
    pthread_t t;
    pthread_create(&t, NULL, server, &srv);
    for (int i = 0; i < 500 && gdaki_channel_connect(server_addr, 5000, &ch) != GDAKI_STATUS_OK; i++) nap_ms(10);
    CHECK(ch != NULL);
    char local[64];
    OK(gdaki_channel_local_addr(ch, local, sizeof local, NULL));
    CHECK(strncmp(local, "127.0.0.1:", 10) == 0);

    gdaki_endpoint mine, bad;
    gdaki_remote_region mine_r;
    OK(gdaki_qp_endpoint(cli.qp, &mine));
    OK(gdaki_region_remote(cli.region, &mine_r));
    bad = mine;
    bad.bytes[4] ^= 1;
    gdaki_hello wrong = {(uint8_t *)"size=8", 6, 0, &bad, 1, 0, &mine_r, 1, 0};
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_channel_send(ch, &wrong));
    LAST_ERROR_HAS("hello.endpoints[0]");
    gdaki_hello null_app = {NULL, 6, 0, &mine, 1, 0, &mine_r, 1, 0};
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_channel_send(ch, &null_app));
    gdaki_hello out = {(uint8_t *)"size=8", 6, 0, &mine, 1, 0, &mine_r, 1, 0};
    OK(gdaki_channel_send(ch, &out));
    uint8_t app[16];
    gdaki_endpoint eps[4];
    gdaki_remote_region regions[4];
    gdaki_hello in = {app, 0, sizeof app, eps, 0, 4, regions, 0, 4};
    OK(gdaki_channel_receive(ch, &in));
    CHECK(in.endpoints_len == 1 && in.regions_len == 1);
    OK(gdaki_qp_connect(cli.qp, &eps[0]));
    OK(gdaki_channel_sync(ch, 1));

    /* Write into the server's region through the exchanged rkey. */
    gdaki_dev_qp *h = NULL;
    gdaki_region_info ri;
    OK(gdaki_qp_host_handle(cli.qp, &h));
    OK(gdaki_region_query(cli.region, &ri));
    uint64_t v = 0xfeedfacecafebeefull, ticket = 0;
    OK(gdaki_region_write(cli.region, 0, &v, sizeof v));
    CHECK(gdaki_put_thread_exclusive(h, regions[0].addr, regions[0].rkey, ri.addr, ri.lkey, 8, 0, &ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    OK(gdaki_channel_sync(ch, 2));
    EXPECT(GDAKI_STATUS_PEER, gdaki_channel_sync(ch, 3));
    pthread_join(t, NULL);
    OK(gdaki_channel_destroy(ch));

    /* A refusal reaches the client with its reason. */
    srv.refuse = 1;
    pthread_create(&t, NULL, server, &srv);
    ch = NULL;
    for (int i = 0; i < 500 && gdaki_channel_connect(server_addr, 5000, &ch) != GDAKI_STATUS_OK; i++) nap_ms(10);
    OK(gdaki_channel_send(ch, &out));
    in.app_cap = sizeof app;
    EXPECT(GDAKI_STATUS_PEER, gdaki_channel_receive(ch, &in));
    LAST_ERROR_HAS("wrong size: the server runs 8 bytes");
    pthread_join(t, NULL);
    OK(gdaki_channel_destroy(ch));
    side_fini(&srv);
    side_fini(&cli);
}

/* A collapsed CQ: many puts complete through its one entry, and one wait covers those before. */
static void collapsed_cq(void) {
    gdaki_qp_config cfg;
    OK(gdaki_qp_config_init(&cfg));
    cfg.sq_size = 16;
    cfg.timeout_ms = 5000;
    gdaki_cq *cq = NULL;
    gdaki_qp *qp = NULL;
    EXPECT(GDAKI_STATUS_INVALID_ARGUMENT, gdaki_cq_create_collapsed(ctx, 3, NULL, &cq));
    EXPECT(GDAKI_STATUS_NULL_ARGUMENT, gdaki_cq_create_collapsed(ctx, 16, NULL, NULL));
    OK(gdaki_cq_create_collapsed(ctx, 16, NULL, &cq));
    OK(gdaki_qp_create(ctx, cq, &cfg, &qp));
    gdaki_endpoint self;
    OK(gdaki_qp_endpoint(qp, &self));
    OK(gdaki_qp_connect(qp, &self));
    gdaki_dev_qp *h = NULL;
    OK(gdaki_qp_host_handle(qp, &h));
    CHECK(h->cq.log_size == 0);
    gdaki_region *mr = NULL;
    OK(gdaki_region_alloc(ctx, 8192, GDAKI_ACCESS_ALL, &mr));
    gdaki_region_info m;
    OK(gdaki_region_query(mr, &m));
    unsigned char pattern[4096];
    for (size_t i = 0; i < sizeof pattern; i++) pattern[i] = (unsigned char)(i * 5 + 1);
    OK(gdaki_region_write(mr, 0, pattern, sizeof pattern));
    uint64_t ticket = 0, first = 0;
    for (uint64_t i = 0; i < 1000; i++) {
        uint64_t off = (i % 256) * 16;
        CHECK(gdaki_put_thread_exclusive(h, m.addr + 4096 + off, m.rkey, m.addr + off, m.lkey, 16, 0, &ticket) ==
              GDAKI_OK);
        if (i == 0) first = ticket;
    }
    CHECK(gdaki_wait_thread_exclusive(h, ticket) == GDAKI_OK);
    CHECK(gdaki_wait_thread_exclusive(h, first) == GDAKI_OK);
    unsigned char got[4096];
    OK(gdaki_region_read(mr, 4096, got, sizeof got));
    CHECK(memcmp(got, pattern, sizeof got) == 0);
    OK(gdaki_qp_destroy(qp));
    OK(gdaki_cq_destroy(cq));
    OK(gdaki_region_destroy(mr));
}

int main(void) {
    library();
    contexts();
    regions();
    queues();
    data_path();
    collapsed_cq();
    two_sided();
    streams();
    sockets();
    socket_service();
    proxy();
    handshake();
    OK(gdaki_context_destroy(ctx));
    printf("api_test: %d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
