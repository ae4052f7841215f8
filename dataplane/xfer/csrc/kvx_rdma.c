/* Thin C layer over libibverbs for kvx-xfer's `rdma` feature: ibv_post_send and ibv_poll_cq
 * are static inline in <infiniband/verbs.h>, so they are reached through these wrappers; the
 * rest is kept here too so the Rust side sees one small, stable ABI. */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvx_rdma {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint8_t port;
    uint32_t psn;
};

struct kvx_rdma_qpinfo {
    uint16_t lid;
    uint32_t qpn;
    uint32_t psn;
    uint8_t gid[16];
};

int kvx_rdma_device_count(void) {
    int n = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l) return -1;
    ibv_free_device_list(l);
    return n;
}

int kvx_rdma_device_name(int i, char *buf, size_t len) {
    int n = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l) return -1;
    int rc = -1;
    if (i >= 0 && i < n) {
        snprintf(buf, len, "%s", ibv_get_device_name(l[i]));
        rc = 0;
    }
    ibv_free_device_list(l);
    return rc;
}

void kvx_rdma_close(struct kvx_rdma *r) {
    if (!r) return;
    if (r->qp) ibv_destroy_qp(r->qp);
    if (r->cq) ibv_destroy_cq(r->cq);
    if (r->pd) ibv_dealloc_pd(r->pd);
    if (r->ctx) ibv_close_device(r->ctx);
    free(r);
}

struct kvx_rdma *kvx_rdma_open(const char *name, uint8_t port, int depth, char *err, size_t errlen) {
    int n = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l || n == 0) {
        if (l) ibv_free_device_list(l);
        snprintf(err, errlen, "no RDMA device found");
        return NULL;
    }
    struct ibv_device *dev = NULL;
    for (int i = 0; i < n; i++)
        if (!name || !name[0] || strcmp(ibv_get_device_name(l[i]), name) == 0) {
            dev = l[i];
            break;
        }
    struct kvx_rdma *r = calloc(1, sizeof *r);
    if (!dev || !r) {
        snprintf(err, errlen, dev ? "out of memory" : "RDMA device not found");
        ibv_free_device_list(l);
        free(r);
        return NULL;
    }
    r->port = port;
    r->psn = (uint32_t)rand() & 0xffffff;
    r->ctx = ibv_open_device(dev);
    ibv_free_device_list(l);
    if (!r->ctx) { snprintf(err, errlen, "ibv_open_device failed"); goto fail; }
    r->pd = ibv_alloc_pd(r->ctx);
    if (!r->pd) { snprintf(err, errlen, "ibv_alloc_pd failed"); goto fail; }
    r->cq = ibv_create_cq(r->ctx, depth * 2, NULL, NULL, 0);
    if (!r->cq) { snprintf(err, errlen, "ibv_create_cq failed"); goto fail; }
    struct ibv_qp_init_attr qa = {
        .send_cq = r->cq, .recv_cq = r->cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
        .cap = { .max_send_wr = depth, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
    };
    r->qp = ibv_create_qp(r->pd, &qa);
    if (!r->qp) { snprintf(err, errlen, "ibv_create_qp failed"); goto fail; }
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = port,
        .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
    if (ibv_modify_qp(r->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        snprintf(err, errlen, "ibv_modify_qp(INIT) failed");
        goto fail;
    }
    return r;
fail:
    kvx_rdma_close(r);
    return NULL;
}

int kvx_rdma_local_info(struct kvx_rdma *r, struct kvx_rdma_qpinfo *out) {
    struct ibv_port_attr pa;
    if (ibv_query_port(r->ctx, r->port, &pa)) return -1;
    union ibv_gid gid;
    if (ibv_query_gid(r->ctx, r->port, 0, &gid)) memset(&gid, 0, sizeof gid);
    out->lid = pa.lid;
    out->qpn = r->qp->qp_num;
    out->psn = r->psn;
    memcpy(out->gid, gid.raw, 16);
    return 0;
}

int kvx_rdma_connect(struct kvx_rdma *r, const struct kvx_rdma_qpinfo *rem) {
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = rem->qpn,
        .rq_psn = rem->psn, .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
        .ah_attr = { .is_global = 1, .dlid = rem->lid, .sl = 0, .src_path_bits = 0, .port_num = r->port,
                     .grh = { .hop_limit = 1, .sgid_index = 0 } },
    };
    memcpy(a.ah_attr.grh.dgid.raw, rem->gid, 16);
    if (ibv_modify_qp(r->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return -1;
    struct ibv_qp_attr s = { .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
                             .sq_psn = r->psn, .max_rd_atomic = 1 };
    return ibv_modify_qp(r->qp, &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                        IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

void *kvx_rdma_reg(struct kvx_rdma *r, void *addr, size_t len, uint32_t *lkey, uint32_t *rkey) {
    struct ibv_mr *mr = ibv_reg_mr(r->pd, addr, len,
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
    if (!mr) return NULL;
    *lkey = mr->lkey;
    *rkey = mr->rkey;
    return mr;
}

int kvx_rdma_dereg(void *mr) { return ibv_dereg_mr((struct ibv_mr *)mr); }

int kvx_rdma_post(struct kvx_rdma *r, int write, uint64_t wr_id, void *laddr, uint32_t len,
                  uint32_t lkey, uint64_t raddr, uint32_t rkey) {
    struct ibv_sge sge = { .addr = (uintptr_t)laddr, .length = len, .lkey = lkey };
    struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
        .opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED,
        .wr.rdma = { .remote_addr = raddr, .rkey = rkey } };
    struct ibv_send_wr *bad = NULL;
    return ibv_post_send(r->qp, &wr, &bad);
}

int kvx_rdma_poll(struct kvx_rdma *r, uint64_t *ids, int *status, int max) {
    struct ibv_wc wc[32];
    if (max > 32) max = 32;
    int n = ibv_poll_cq(r->cq, max, wc);
    for (int i = 0; i < n; i++) {
        ids[i] = wc[i].wr_id;
        status[i] = wc[i].status;
    }
    return n;
}
