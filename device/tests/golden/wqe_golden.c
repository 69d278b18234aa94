/* Whole-WQE golden encoder for gdaki-device's tests: composes each WQE the way rdma-core's mlx5
 * provider does (mlx5dv_set_ctrl_seg, mlx5dv_set_data_seg, the mlx5_wqe_raddr_seg,
 * mlx5_wqe_atomic_seg and mlx5_wqe_inl_data_seg structs, the DS count qp.c computes: 16-byte
 * units of control + remote address + data, inline rounded up to 16 bytes and no inline segment
 * at all for 0 bytes), into a zeroed 64-byte building block. One request per line on stdin;
 * prints the DS count and the WQE's ds * 16 bytes in hex. */
#include <endian.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/mlx5dv.h>

/* Not in mlx5dv.h: the PRM's fence mode 2 ("fence", the kernel's MLX5_FENCE_MODE_FENCE) and
 * the DUMP opcode (NVSHMEM's IBGDA_MLX5_OPCODE_DUMP, DOCA's ..._OPCODE_DUMP). */
#define PRM_FENCE_MODE_FENCE (2 << 5)
#define PRM_OPCODE_DUMP 0x23

static uint8_t wqe[MLX5_SEND_WQE_BB];

static void emit(unsigned ds) {
	printf("%u ", ds);
	for (unsigned i = 0; i < ds * 16; i++)
		printf("%02x", wqe[i]);
	printf("\n");
}

static void ctrl(unsigned pi, unsigned opcode, unsigned qpn, unsigned fm_ce_se, unsigned ds) {
	mlx5dv_set_ctrl_seg((struct mlx5_wqe_ctrl_seg *)wqe, pi, opcode, 0, qpn, fm_ce_se, ds, 0, 0);
}

static void raddr(void *at, uint64_t addr, uint32_t rkey) {
	struct mlx5_wqe_raddr_seg *r = at;
	r->raddr = htobe64(addr);
	r->rkey = htobe32(rkey);
	r->reserved = 0;
}

int main(void) {
	char kind[32];
	while (scanf("%31s", kind) == 1) {
		unsigned pi, qpn, fm, rkey, lkey, len;
		uint64_t raddr_v, laddr;
		memset(wqe, 0, sizeof wqe);
		uint8_t *seg = wqe + sizeof(struct mlx5_wqe_ctrl_seg);
		if (!strcmp(kind, "nop")) {
			if (scanf("%u %u %u", &pi, &qpn, &fm) != 3) return 2;
			ctrl(pi, MLX5_OPCODE_NOP, qpn, MLX5_WQE_CTRL_CQ_UPDATE | fm, 1);
			emit(1);
		} else if (!strcmp(kind, "write") || !strcmp(kind, "read")) {
			if (scanf("%u %u %u %" SCNu64 " %u %" SCNu64 " %u %u", &pi, &qpn, &fm, &raddr_v, &rkey, &laddr,
				  &lkey, &len) != 8)
				return 2;
			unsigned op = kind[0] == 'w' ? MLX5_OPCODE_RDMA_WRITE : MLX5_OPCODE_RDMA_READ;
			unsigned ds = (sizeof(struct mlx5_wqe_ctrl_seg) + sizeof(struct mlx5_wqe_raddr_seg) +
				       sizeof(struct mlx5_wqe_data_seg)) / 16;
			ctrl(pi, op, qpn, MLX5_WQE_CTRL_CQ_UPDATE | fm, ds);
			raddr(seg, raddr_v, rkey);
			mlx5dv_set_data_seg((struct mlx5_wqe_data_seg *)(seg + sizeof(struct mlx5_wqe_raddr_seg)), len,
					    lkey, (uintptr_t)laddr);
			emit(ds);
		} else if (!strcmp(kind, "inline")) {
			char hex[64];
			if (scanf("%u %u %u %" SCNu64 " %u %u %63s", &pi, &qpn, &fm, &raddr_v, &rkey, &len, hex) != 7)
				return 2;
			raddr(seg, raddr_v, rkey);
			struct mlx5_wqe_inl_data_seg *inl = (void *)(seg + sizeof(struct mlx5_wqe_raddr_seg));
			unsigned sz = 0; /* qp.c's set_data_inl_seg: no segment for 0 bytes */
			if (len) {
				inl->byte_count = htobe32(len | MLX5_INLINE_SEG);
				for (unsigned i = 0; i < len; i++)
					sscanf(hex + 2 * i, "%2hhx", (uint8_t *)(inl + 1) + i);
				sz = (len + sizeof(inl->byte_count) + 15) / 16;
			}
			unsigned ds = (sizeof(struct mlx5_wqe_ctrl_seg) + sizeof(struct mlx5_wqe_raddr_seg)) / 16 + sz;
			ctrl(pi, MLX5_OPCODE_RDMA_WRITE, qpn, MLX5_WQE_CTRL_CQ_UPDATE | fm, ds);
			emit(ds);
		} else if (!strcmp(kind, "fa") || !strcmp(kind, "cs")) {
			uint64_t swap_add, compare;
			if (scanf("%u %u %u %" SCNu64 " %u %" SCNu64 " %u %" SCNu64 " %" SCNu64, &pi, &qpn, &fm, &raddr_v,
				  &rkey, &laddr, &lkey, &swap_add, &compare) != 9)
				return 2;
			unsigned op = kind[0] == 'f' ? MLX5_OPCODE_ATOMIC_FA : MLX5_OPCODE_ATOMIC_CS;
			unsigned ds = (sizeof(struct mlx5_wqe_ctrl_seg) + sizeof(struct mlx5_wqe_raddr_seg) +
				       sizeof(struct mlx5_wqe_atomic_seg) + sizeof(struct mlx5_wqe_data_seg)) / 16;
			ctrl(pi, op, qpn, MLX5_WQE_CTRL_CQ_UPDATE | fm, ds);
			raddr(seg, raddr_v, rkey);
			/* qp.c's set_atomic_seg: the swap (or addend) first, then the compare value. */
			struct mlx5_wqe_atomic_seg *a = (void *)(seg + sizeof(struct mlx5_wqe_raddr_seg));
			a->swap_add = htobe64(swap_add);
			a->compare = htobe64(op == MLX5_OPCODE_ATOMIC_CS ? compare : 0);
			mlx5dv_set_data_seg((struct mlx5_wqe_data_seg *)(a + 1), 8, lkey, (uintptr_t)laddr);
			emit(ds);
		} else if (!strcmp(kind, "dump")) {
			if (scanf("%u %u %u %" SCNu64 " %u %u", &pi, &qpn, &fm, &laddr, &lkey, &len) != 6) return 2;
			unsigned ds = (sizeof(struct mlx5_wqe_ctrl_seg) + sizeof(struct mlx5_wqe_data_seg)) / 16;
			ctrl(pi, PRM_OPCODE_DUMP, qpn, MLX5_WQE_CTRL_CQ_UPDATE | fm, ds);
			mlx5dv_set_data_seg((struct mlx5_wqe_data_seg *)seg, len, lkey, (uintptr_t)laddr);
			emit(ds);
		} else if (!strcmp(kind, "fence")) {
			printf("%d\n", PRM_FENCE_MODE_FENCE);
		} else {
			return 3;
		}
		fflush(stdout);
	}
	return 0;
}
