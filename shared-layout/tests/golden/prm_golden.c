/* Golden encoder for PRM command mailboxes: fills each mailbox field by field with rdma-core's
 * DEVX_SET over the kernel's own structure definitions (mlx5_ifc.h, path given as KERNEL_MLX5_IFC),
 * from values read on stdin, and prints the mailbox in hex. The DevX-only fields the kernel
 * header leaves reserved are written at the bit offsets rdma-core's own mlx5_ifc.h gives them.
 *
 * Input lines (decimal numbers):
 *   create_cq  log_size uar_page eqn umem_id umem_offset dbr_umem_id dbr_offset log_page_size oi cc
 *   create_qp  pd uar_page cqn_snd cqn_rcv log_sq_size user_index umem_id umem_offset
 *              dbr_umem_id dbr_offset log_page_size ts_format rq log_rq_size log_rq_stride
 *              cd_master send_dbr_mode
 *              (rq 0: send-only, a zero-length RQ; 1: a regular RQ of that shape)
 *   rst2init   qpn port pkey_index rre rwe rae atomic_mode
 *   init2rtr   qpn mtu log_msg_max remote_qpn next_rcv_psn min_rnr_nak log_rra_max
 *              port rlid sl grh gid_index rgid_hi rgid_lo hop_limit tclass rmac udp_sport
 *   rtr2rts    qpn next_send_psn retry_count rnr_retry ack_timeout log_sra_max
 *   object     opcode number
 *   query_cap  type
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <infiniband/mlx5dv.h>

typedef uint8_t u8;
#define BIT(n) (1UL << (n))
#define BIT_ULL(n) (1ULL << (n))
#define __packed __attribute__((packed))
#include KERNEL_MLX5_IFC

/* Sets `width` bits at bit `off` (MSB-first, big-endian dwords), for the reserved DevX fields. */
static void set_raw(uint8_t *p, unsigned off, unsigned width, uint64_t v) {
	for (unsigned i = 0; i < width; i++) {
		unsigned pos = off + i;
		unsigned bit = (v >> (width - 1 - i)) & 1;
		uint8_t mask = 1u << (7 - pos % 8);
		p[pos / 8] = bit ? (p[pos / 8] | mask) : (p[pos / 8] & ~mask);
	}
}

static void print(const uint8_t *p, size_t n) {
	for (size_t i = 0; i < n; i++)
		printf("%02x", p[i]);
	printf("\n");
}

int main(void) {
	char kind[32];
	while (scanf("%31s", kind) == 1) {
		uint8_t b[DEVX_ST_SZ_BYTES(create_qp_in)];
		memset(b, 0, sizeof(b));
		if (!strcmp(kind, "create_cq")) {
			uint64_t log_size, uar, eqn, umem, umem_off, dbr_umem, dbr_off, lps, oi, cc;
			if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
				  " %" SCNu64 " %" SCNu64 " %" SCNu64,
				  &log_size, &uar, &eqn, &umem, &umem_off, &dbr_umem, &dbr_off, &lps, &oi, &cc) != 10)
				return 2;
			DEVX_SET(create_cq_in, b, opcode, MLX5_CMD_OP_CREATE_CQ);
			DEVX_SET(create_cq_in, b, cq_umem_valid, 1);
			set_raw(b, 0x2c0, 32, umem);     /* cq_umem_id */
			set_raw(b, 0x280, 64, umem_off); /* cq_umem_offset */
			void *cq = DEVX_ADDR_OF(create_cq_in, b, cq_context);
			DEVX_SET(cqc, cq, dbr_umem_valid, 1);
			set_raw(cq, 0x20, 32, dbr_umem); /* cqc.dbr_umem_id */
			DEVX_SET64(cqc, cq, dbr_addr, dbr_off);
			DEVX_SET(cqc, cq, cqe_sz, 0);
			DEVX_SET(cqc, cq, oi, oi);
			DEVX_SET(cqc, cq, cc, cc);
			DEVX_SET(cqc, cq, log_cq_size, log_size);
			DEVX_SET(cqc, cq, uar_page, uar);
			DEVX_SET(cqc, cq, c_eqn_or_apu_element, eqn);
			DEVX_SET(cqc, cq, log_page_size, lps);
			print(b, DEVX_ST_SZ_BYTES(create_cq_in));
		} else if (!strcmp(kind, "create_qp")) {
			uint64_t pd, uar, snd, rcv, log_sq, uidx, umem, umem_off, dbr_umem, dbr_off, lps, ts, rq, log_rq,
				rq_stride, cd_master, send_dbr_mode;
			if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
				  " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
				  " %" SCNu64 " %" SCNu64 " %" SCNu64,
				  &pd, &uar, &snd, &rcv, &log_sq, &uidx, &umem, &umem_off, &dbr_umem, &dbr_off, &lps, &ts,
				  &rq, &log_rq, &rq_stride, &cd_master, &send_dbr_mode) != 17)
				return 2;
			DEVX_SET(create_qp_in, b, opcode, MLX5_CMD_OP_CREATE_QP);
			DEVX_SET(create_qp_in, b, wq_umem_valid, 1);
			set_raw(b, 0x840, 32, umem);     /* wq_umem_id */
			set_raw(b, 0x800, 64, umem_off); /* wq_umem_offset */
			void *qpc = DEVX_ADDR_OF(create_qp_in, b, qpc);
			DEVX_SET(qpc, qpc, st, MLX5_QPC_ST_RC);
			DEVX_SET(qpc, qpc, pm_state, MLX5_QPC_PM_STATE_MIGRATED);
			DEVX_SET(qpc, qpc, pd, pd);
			DEVX_SET(qpc, qpc, uar_page, uar);
			DEVX_SET(qpc, qpc, user_index, uidx);
			DEVX_SET(qpc, qpc, log_page_size, lps);
			DEVX_SET(qpc, qpc, log_sq_size, log_sq);
			DEVX_SET(qpc, qpc, ts_format, ts);
			DEVX_SET(qpc, qpc, cd_master, cd_master);
			/* rdma-core's qpc.send_dbr_mode (bits 0x80..0x82), reserved_at_80 in the kernel's */
			set_raw(qpc, 0x80, 2, send_dbr_mode);
			if (rq) {
				DEVX_SET(qpc, qpc, rq_type, 0 /* MLX5_NON_ZERO_RQ */);
				DEVX_SET(qpc, qpc, log_rq_size, log_rq);
				DEVX_SET(qpc, qpc, log_rq_stride, rq_stride);
			} else {
				DEVX_SET(qpc, qpc, rq_type, 3 /* MLX5_ZERO_LEN_RQ */);
				DEVX_SET(qpc, qpc, log_rq_size, 0);
			}
			DEVX_SET(qpc, qpc, cqn_snd, snd);
			DEVX_SET(qpc, qpc, cqn_rcv, rcv);
			DEVX_SET(qpc, qpc, dbr_umem_valid, 1);
			set_raw(qpc, 0x720, 32, dbr_umem); /* qpc.dbr_umem_id */
			DEVX_SET64(qpc, qpc, dbr_addr, dbr_off);
			print(b, DEVX_ST_SZ_BYTES(create_qp_in));
		} else if (!strcmp(kind, "rst2init")) {
			uint64_t qpn, port, pkey, rre, rwe, rae, amode;
			if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &qpn,
				  &port, &pkey, &rre, &rwe, &rae, &amode) != 7)
				return 2;
			DEVX_SET(rst2init_qp_in, b, opcode, MLX5_CMD_OP_RST2INIT_QP);
			DEVX_SET(rst2init_qp_in, b, qpn, qpn);
			void *qpc = DEVX_ADDR_OF(rst2init_qp_in, b, qpc);
			DEVX_SET(qpc, qpc, pm_state, MLX5_QPC_PM_STATE_MIGRATED);
			DEVX_SET(qpc, qpc, rre, rre);
			DEVX_SET(qpc, qpc, rwe, rwe);
			DEVX_SET(qpc, qpc, rae, rae);
			DEVX_SET(qpc, qpc, atomic_mode, amode);
			DEVX_SET(qpc, qpc, primary_address_path.vhca_port_num, port);
			DEVX_SET(qpc, qpc, primary_address_path.pkey_index, pkey);
			print(b, DEVX_ST_SZ_BYTES(rst2init_qp_in));
		} else if (!strcmp(kind, "init2rtr")) {
			uint64_t qpn, mtu, lmm, rqpn, psn, rnr, rra, port, rlid, sl, grh, gidx, hi, lo, hop, tc, mac, sport;
			if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
				  " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
				  " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64,
				  &qpn, &mtu, &lmm, &rqpn, &psn, &rnr, &rra, &port, &rlid, &sl, &grh, &gidx, &hi, &lo, &hop,
				  &tc, &mac, &sport) != 18)
				return 2;
			DEVX_SET(init2rtr_qp_in, b, opcode, MLX5_CMD_OP_INIT2RTR_QP);
			DEVX_SET(init2rtr_qp_in, b, qpn, qpn);
			void *qpc = DEVX_ADDR_OF(init2rtr_qp_in, b, qpc);
			DEVX_SET(qpc, qpc, mtu, mtu);
			DEVX_SET(qpc, qpc, log_msg_max, lmm);
			DEVX_SET(qpc, qpc, remote_qpn, rqpn);
			DEVX_SET(qpc, qpc, next_rcv_psn, psn);
			DEVX_SET(qpc, qpc, min_rnr_nak, rnr);
			DEVX_SET(qpc, qpc, log_rra_max, rra);
			void *ap = DEVX_ADDR_OF(qpc, qpc, primary_address_path);
			DEVX_SET(ads, ap, vhca_port_num, port);
			DEVX_SET(ads, ap, rlid, rlid);
			DEVX_SET(ads, ap, sl, sl);
			DEVX_SET(ads, ap, grh, grh);
			DEVX_SET(ads, ap, src_addr_index, gidx);
			uint8_t *gid = DEVX_ADDR_OF(ads, ap, rgid_rip);
			for (int i = 0; i < 8; i++) {
				gid[i] = hi >> (56 - 8 * i);
				gid[8 + i] = lo >> (56 - 8 * i);
			}
			DEVX_SET(ads, ap, hop_limit, hop);
			DEVX_SET(ads, ap, tclass, tc);
			DEVX_SET(ads, ap, rmac_47_32, mac >> 32);
			DEVX_SET(ads, ap, rmac_31_0, mac & 0xffffffffu);
			DEVX_SET(ads, ap, udp_sport, sport);
			print(b, DEVX_ST_SZ_BYTES(init2rtr_qp_in));
		} else if (!strcmp(kind, "rtr2rts")) {
			uint64_t qpn, psn, retry, rnr, ack, sra;
			if (scanf("%" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &qpn, &psn,
				  &retry, &rnr, &ack, &sra) != 6)
				return 2;
			DEVX_SET(rtr2rts_qp_in, b, opcode, MLX5_CMD_OP_RTR2RTS_QP);
			DEVX_SET(rtr2rts_qp_in, b, qpn, qpn);
			void *qpc = DEVX_ADDR_OF(rtr2rts_qp_in, b, qpc);
			DEVX_SET(qpc, qpc, next_send_psn, psn);
			DEVX_SET(qpc, qpc, retry_count, retry);
			DEVX_SET(qpc, qpc, rnr_retry, rnr);
			DEVX_SET(qpc, qpc, log_sra_max, sra);
			DEVX_SET(qpc, qpc, log_ack_req_freq, 0);
			DEVX_SET(qpc, qpc, primary_address_path.ack_timeout, ack);
			print(b, DEVX_ST_SZ_BYTES(rtr2rts_qp_in));
		} else if (!strcmp(kind, "object")) {
			uint64_t op, n;
			if (scanf("%" SCNu64 " %" SCNu64, &op, &n) != 2)
				return 2;
			DEVX_SET(destroy_qp_in, b, opcode, op);
			DEVX_SET(destroy_qp_in, b, qpn, n);
			print(b, DEVX_ST_SZ_BYTES(destroy_qp_in));
		} else if (!strcmp(kind, "query_cap")) {
			uint64_t type;
			if (scanf("%" SCNu64, &type) != 1)
				return 2;
			DEVX_SET(query_hca_cap_in, b, opcode, MLX5_CMD_OP_QUERY_HCA_CAP);
			DEVX_SET(query_hca_cap_in, b, op_mod, (type << 1) | 1 /* current values */);
			print(b, DEVX_ST_SZ_BYTES(query_hca_cap_in));
		} else {
			return 3;
		}
	}
	return 0;
}
