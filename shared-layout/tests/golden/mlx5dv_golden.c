/* Golden encoder for gdaki-layout's tests: encodes WQE segments and decodes CQEs with
 * rdma-core's own definitions and helpers from <infiniband/mlx5dv.h>, one request per line on
 * stdin, hex bytes or decimal fields on stdout. The Rust side sends random inputs and compares. */
#include <endian.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/mlx5dv.h>

static void hex(const void *p, size_t n) {
	const uint8_t *b = p;
	for (size_t i = 0; i < n; i++)
		printf("%02x", b[i]);
	printf("\n");
}

int main(void) {
	char kind[32];
	while (scanf("%31s", kind) == 1) {
		if (!strcmp(kind, "ctrl")) {
			unsigned pi, opcode, opmod, qpn, fm_ce_se, ds, sig, imm;
			if (scanf("%u %u %u %u %u %u %u %u", &pi, &opcode, &opmod, &qpn, &fm_ce_se, &ds, &sig, &imm) != 8) return 2;
			struct mlx5_wqe_ctrl_seg seg;
			memset(&seg, 0xa5, sizeof seg);
			seg.dci_stream_channel_id = 0;
			mlx5dv_set_ctrl_seg(&seg, pi, opcode, opmod, qpn, fm_ce_se, ds, sig, htobe32(imm));
			hex(&seg, sizeof seg);
		} else if (!strcmp(kind, "data")) {
			uint32_t len, lkey; uint64_t addr;
			if (scanf("%" SCNu32 " %" SCNu32 " %" SCNu64, &len, &lkey, &addr) != 3) return 2;
			struct mlx5_wqe_data_seg seg;
			mlx5dv_set_data_seg(&seg, len, lkey, (uintptr_t)addr);
			hex(&seg, sizeof seg);
		} else if (!strcmp(kind, "raddr")) {
			uint64_t addr; uint32_t rkey;
			if (scanf("%" SCNu64 " %" SCNu32, &addr, &rkey) != 2) return 2;
			struct mlx5_wqe_raddr_seg seg = { .raddr = htobe64(addr), .rkey = htobe32(rkey), .reserved = 0 };
			hex(&seg, sizeof seg);
		} else if (!strcmp(kind, "atomic")) {
			uint64_t swap_add, compare;
			if (scanf("%" SCNu64 " %" SCNu64, &swap_add, &compare) != 2) return 2;
			struct mlx5_wqe_atomic_seg seg = { .swap_add = htobe64(swap_add), .compare = htobe64(compare) };
			hex(&seg, sizeof seg);
		} else if (!strcmp(kind, "cqe")) {
			char text[129];
			if (scanf("%128s", text) != 1) return 2;
			uint8_t raw[64];
			for (int i = 0; i < 64; i++) sscanf(text + 2 * i, "%2hhx", &raw[i]);
			struct mlx5_cqe64 *cqe = (struct mlx5_cqe64 *)raw;
			struct mlx5_err_cqe *err = (struct mlx5_err_cqe *)raw;
			/* The immediate as verbs hands it over (ibv_wc.imm_data, network order) and the
			 * source QP as mlx5's poll reads it. */
			printf("%u %u %u %u %u %u %u %u %u %u %u %u\n", mlx5dv_get_cqe_opcode(cqe), mlx5dv_get_cqe_owner(cqe),
			       mlx5dv_get_cqe_se(cqe), mlx5dv_get_cqe_format(cqe), be16toh(cqe->wqe_counter),
			       be32toh(cqe->byte_cnt), be32toh(cqe->sop_drop_qpn) & 0xffffff, err->syndrome,
			       err->vendor_err_synd, be32toh(err->s_wqe_opcode_qpn) >> 24, be32toh(cqe->imm_inval_pkey),
			       be32toh(cqe->flags_rqpn) & 0xffffff);
		} else if (!strcmp(kind, "layout")) {
			printf("%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\n",
			       sizeof(struct mlx5_wqe_ctrl_seg), offsetof(struct mlx5_wqe_ctrl_seg, qpn_ds),
			       offsetof(struct mlx5_wqe_ctrl_seg, fm_ce_se), offsetof(struct mlx5_wqe_ctrl_seg, imm),
			       sizeof(struct mlx5_wqe_raddr_seg), sizeof(struct mlx5_wqe_data_seg),
			       sizeof(struct mlx5_wqe_atomic_seg), sizeof(struct mlx5_cqe64),
			       offsetof(struct mlx5_cqe64, byte_cnt), offsetof(struct mlx5_cqe64, wqe_counter),
			       offsetof(struct mlx5_cqe64, op_own), offsetof(struct mlx5_err_cqe, syndrome),
			       offsetof(struct mlx5_err_cqe, vendor_err_synd), offsetof(struct mlx5_err_cqe, s_wqe_opcode_qpn),
			       (size_t)MLX5_SEND_WQE_BB, (size_t)MLX5_INLINE_SEG);
			printf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d %d %d\n", MLX5_WQE_CTRL_CQ_UPDATE,
			       MLX5_WQE_CTRL_SOLICITED, MLX5_WQE_CTRL_FENCE, MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE,
			       MLX5_SND_DBR, MLX5_RCV_DBR, MLX5_CQE_OWNER_MASK, MLX5_CQE_INVALID, MLX5_INVALID_LKEY,
			       MLX5_CQE_RESP_WR_IMM, MLX5_CQE_RESP_SEND, MLX5_CQE_RESP_SEND_IMM, MLX5_CQE_RESP_ERR,
			       MLX5_OPCODE_SEND, MLX5_OPCODE_SEND_IMM, MLX5_OPCODE_RDMA_WRITE_IMM);
			printf("%zu %zu\n", offsetof(struct mlx5_cqe64, imm_inval_pkey), offsetof(struct mlx5_cqe64, flags_rqpn));
		} else {
			return 3;
		}
		fflush(stdout);
	}
	return 0;
}
