/* A stand-in for gdrcopy's libgdrapi (version 2 ABI, as gdrapi.h declares it) for machines
 * without gdrdrv: "device" addresses are host addresses, a mapping is the pinned range itself,
 * and every call is logged (standin_log) so a test can check the sequence gdaki makes. It
 * refuses what gdrdrv refuses: pins that are not whole 64 KiB GPU pages, maps of another size,
 * handles it did not give.
 *
 * With STANDIN_CUDA=1 in the environment the addresses are real GPU memory (a GPU machine
 * without gdrdrv): a pin must name device memory whose CU_POINTER_ATTRIBUTE_SYNC_MEMOPS is set
 * (what gdrcopy asks of every buffer it pins), and the copies are CUDA copies in the memory's
 * own context, libcuda loaded at run time. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAGE 65536UL
#define PINS 16

typedef struct { unsigned long h; } gdr_mh_t;
struct gdr { int open; };
struct pin { unsigned long addr; size_t size; int mapped; };

static struct gdr the;
static struct pin pins[PINS];
static char calls[4096];

static void note(const char *what) {
	size_t used = strlen(calls);
	if (used + strlen(what) + 2 < sizeof calls) {
		strcat(calls, what);
		strcat(calls, " ");
	}
}

static struct pin *pin_of(gdr_mh_t h) {
	return h.h >= 1 && h.h <= PINS && pins[h.h - 1].size ? &pins[h.h - 1] : NULL;
}

const char *standin_log(void) { return calls; }

/* libcuda's few entry points the CUDA mode needs (CUresult is an int, 0 success). */
typedef int (*attr_fn)(void *, int, unsigned long long);
typedef int (*ctx_fn)(void *);
typedef int (*pop_fn)(void **);
typedef int (*htod_fn)(unsigned long long, const void *, size_t);
typedef int (*dtoh_fn)(void *, unsigned long long, size_t);
static struct {
	int loaded;
	attr_fn attr;
	ctx_fn push;
	pop_fn pop;
	htod_fn htod;
	dtoh_fn dtoh;
} cu;

/* 1 in CUDA mode, 0 in the plain one, -1 when CUDA mode is asked for and libcuda is not
 * there (every call then refuses). Asked at every call: a test turns the mode on after using
 * the plain one. */
static int cuda_mode(void) {
	const char *want = getenv("STANDIN_CUDA");
	if (!want || strcmp(want, "1")) return 0;
	if (!cu.loaded) {
		void *lib = dlopen("libcuda.so.1", RTLD_NOW);
		if (!lib) return -1;
		cu.attr = (attr_fn)dlsym(lib, "cuPointerGetAttribute");
		cu.push = (ctx_fn)dlsym(lib, "cuCtxPushCurrent_v2");
		cu.pop = (pop_fn)dlsym(lib, "cuCtxPopCurrent_v2");
		cu.htod = (htod_fn)dlsym(lib, "cuMemcpyHtoD_v2");
		cu.dtoh = (dtoh_fn)dlsym(lib, "cuMemcpyDtoH_v2");
		cu.loaded = cu.attr && cu.push && cu.pop && cu.htod && cu.dtoh;
	}
	return cu.loaded ? 1 : -1;
}

/* CU_POINTER_ATTRIBUTE_{CONTEXT, MEMORY_TYPE, SYNC_MEMOPS}; CU_MEMORYTYPE_DEVICE. */
enum { ATTR_CONTEXT = 1, ATTR_MEMORY_TYPE = 2, ATTR_SYNC_MEMOPS = 6, MEMORYTYPE_DEVICE = 2 };

static int device_memory_synced(unsigned long addr) {
	unsigned int type = 0, sync = 0;
	return !cu.attr(&type, ATTR_MEMORY_TYPE, addr) && type == MEMORYTYPE_DEVICE &&
	       !cu.attr(&sync, ATTR_SYNC_MEMOPS, addr) && sync == 1;
}

/* A copy between host memory and the device memory at `dev`, in that memory's context. */
static int cuda_copy(unsigned long dev, void *host, size_t n, int to_device) {
	void *ctx = NULL, *popped = NULL;
	if (cu.attr(&ctx, ATTR_CONTEXT, dev) || cu.push(ctx)) return 5;
	int rc = to_device ? cu.htod(dev, host, n) : cu.dtoh(host, dev, n);
	cu.pop(&popped);
	return rc ? 5 : 0;
}

void gdr_runtime_get_version(int *major, int *minor) { *major = 2; *minor = 5; }

struct gdr *gdr_open(void) { note("open"); the.open = 1; return &the; }

int gdr_close(struct gdr *g) { note("close"); return g == &the && the.open-- == 1 ? 0 : -1; }

int gdr_pin_buffer(struct gdr *g, unsigned long addr, size_t size, uint64_t token, uint32_t va_space, gdr_mh_t *h) {
	(void)token; (void)va_space;
	if (g != &the || addr % PAGE || size % PAGE || !size) { note("pin-refused"); return 22; }
	int cuda = cuda_mode();
	if (cuda < 0 || (cuda && !device_memory_synced(addr))) { note("pin-refused-not-synced-device-memory"); return 22; }
	for (unsigned i = 0; i < PINS; i++)
		if (!pins[i].size) {
			pins[i] = (struct pin){addr, size, 0};
			h->h = i + 1;
			note("pin");
			return 0;
		}
	return 12;
}

int gdr_unpin_buffer(struct gdr *g, gdr_mh_t h) {
	struct pin *p = pin_of(h);
	if (g != &the || !p || p->mapped) { note("unpin-refused"); return 22; }
	p->size = 0;
	note("unpin");
	return 0;
}

int gdr_map(struct gdr *g, gdr_mh_t h, void **va, size_t size) {
	struct pin *p = pin_of(h);
	if (g != &the || !p || size != p->size) { note("map-refused"); return 22; }
	p->mapped = 1;
	*va = (void *)p->addr;
	note("map");
	return 0;
}

int gdr_unmap(struct gdr *g, gdr_mh_t h, void *va, size_t size) {
	struct pin *p = pin_of(h);
	if (g != &the || !p || !p->mapped || va != (void *)p->addr || size != p->size) { note("unmap-refused"); return 22; }
	p->mapped = 0;
	note("unmap");
	return 0;
}

static int inside(gdr_mh_t h, const void *at, size_t n) {
	struct pin *p = pin_of(h);
	return p && p->mapped && (unsigned long)at >= p->addr && (unsigned long)at + n <= p->addr + p->size;
}

int gdr_copy_to_mapping(gdr_mh_t h, void *map_d_ptr, const void *h_ptr, size_t size) {
	if (!inside(h, map_d_ptr, size)) { note("copy_to-refused"); return 22; }
	int cuda = cuda_mode();
	if (cuda) {
		if (cuda < 0 || cuda_copy((unsigned long)map_d_ptr, (void *)h_ptr, size, 1)) { note("copy_to-failed"); return 5; }
	} else {
		memcpy(map_d_ptr, h_ptr, size);
	}
	note("copy_to");
	return 0;
}

int gdr_copy_from_mapping(gdr_mh_t h, void *h_ptr, const void *map_d_ptr, size_t size) {
	if (!inside(h, map_d_ptr, size)) { note("copy_from-refused"); return 22; }
	int cuda = cuda_mode();
	if (cuda) {
		if (cuda < 0 || cuda_copy((unsigned long)map_d_ptr, h_ptr, size, 0)) { note("copy_from-failed"); return 5; }
	} else {
		memcpy(h_ptr, map_d_ptr, size);
	}
	note("copy_from");
	return 0;
}
