/* A stand-in for gdrcopy's libgdrapi (version 2 ABI, as gdrapi.h declares it) for machines
 * without gdrdrv: "device" addresses are host addresses, a mapping is the pinned range itself,
 * and every call is logged (standin_log) so a test can check the sequence gdaki makes. It
 * refuses what gdrdrv refuses: pins that are not whole 64 KiB GPU pages, maps of another size,
 * handles it did not give. */
#include <stddef.h>
#include <stdint.h>
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

void gdr_runtime_get_version(int *major, int *minor) { *major = 2; *minor = 5; }

struct gdr *gdr_open(void) { note("open"); the.open = 1; return &the; }

int gdr_close(struct gdr *g) { note("close"); return g == &the && the.open-- == 1 ? 0 : -1; }

int gdr_pin_buffer(struct gdr *g, unsigned long addr, size_t size, uint64_t token, uint32_t va_space, gdr_mh_t *h) {
	(void)token; (void)va_space;
	if (g != &the || addr % PAGE || size % PAGE || !size) { note("pin-refused"); return 22; }
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
	memcpy(map_d_ptr, h_ptr, size);
	note("copy_to");
	return 0;
}

int gdr_copy_from_mapping(gdr_mh_t h, void *h_ptr, const void *map_d_ptr, size_t size) {
	if (!inside(h, map_d_ptr, size)) { note("copy_from-refused"); return 22; }
	memcpy(h_ptr, map_d_ptr, size);
	note("copy_from");
	return 0;
}
