"""The dK/dV kernel of FlashAttention-2, under the conventions of _flash_attention_kernels.py (layouts, the
head dim's one or two blocks, lower-right causal alignment, document masking, base-2 scores, masked and
unmasked loops, IEEE dots): the forward, the preprocessing and dQ live there.
"""

import triton
import triton.language as tl


@triton.jit
def _dkdv_tile(
    dk, dk2, dv, k, k2, v, q_ptrs, q2_ptrs, do_ptrs, lse_base, delta_base, start_m, q_len, diag, qk_scale,
    cols, offs_m, d_ok, d2_ok, dv_ok, k_doc, doc_row,
    BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, MASKED: tl.constexpr,
):
    # The query block from start_m: q_ptrs, q2_ptrs and do_ptrs point at its rows. Works on transposed
    # scores (keys x queries) so that dK and dV accumulate along rows.
    rows = start_m + offs_m
    row_ok = rows < q_len
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
    # Rows past q_len get lse = +inf, hence p = 0, so they add nothing.
    lse2 = tl.load(lse_base + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
    if BLOCK_D2 > 0:
        q2 = tl.load(q2_ptrs, mask=row_ok[:, None] & d2_ok, other=0.0)
        s_t = tl.dot(k2, tl.trans(q2), s_t, input_precision="ieee")
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        if IS_CAUSAL:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diag, p_t, 0.0)
        if HAS_DOCS:
            q_doc = tl.load(doc_row + rows + diag, mask=row_ok, other=-2)
            p_t = tl.where(k_doc[:, None] == q_doc[None, :], p_t, 0.0)
    do = tl.load(do_ptrs, mask=row_ok[:, None] & dv_ok, other=0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
    if BLOCK_D2 > 0:
        dk2 = tl.dot(ds_t.to(q2.dtype), q2, dk2, input_precision="ieee")
    return dk, dk2, dv


@triton.jit
def _dkdv_run(
    dk, dk2, dv, k, k2, v, q_ptrs, q2_ptrs, do_ptrs, stride_qm, stride_dom, lse_base, delta_base,
    lo, hi, q_len, diag, qk_scale, cols, offs_m, d_ok, d2_ok, dv_ok, k_doc, doc_row,
    BLOCK_M: tl.constexpr, BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    MASKED: tl.constexpr,
):
    # The query blocks [lo, hi); q_ptrs, q2_ptrs and do_ptrs point at query row `lo`.
    for start_m in range(lo, hi, BLOCK_M):
        dk, dk2, dv = _dkdv_tile(dk, dk2, dv, k, k2, v, q_ptrs, q2_ptrs, do_ptrs, lse_base, delta_base, start_m,
                                 q_len, diag, qk_scale, cols, offs_m, d_ok, d2_ok, dv_ok, k_doc, doc_row,
                                 BLOCK_D2, IS_CAUSAL, HAS_DOCS, MASKED)
        q_ptrs += BLOCK_M * stride_qm
        if BLOCK_D2 > 0:
            q2_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dk2, dv


@triton.jit
def _key_block_span(doc_row, end_row, start_n, last_col, lo, q_len, diag, BLOCK_M: tl.constexpr):
    """(lo, hi): the query blocks the keys start_n..last_col meet under document masking, from the one holding
    their first key's document start to their last key's document end (`lo`: the first without documents)."""
    lo = tl.maximum(lo, tl.maximum(tl.load(doc_row + start_n) - diag, 0) // BLOCK_M * BLOCK_M)
    return lo, tl.minimum(q_len, tl.load(end_row + last_col) - diag)


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA, DOC_START, DOC_END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    q_heads, kv_heads, group, q_len, kv_len, qk_scale, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key block, kv head, batch); it loops over the kv head's group of query
    heads, so grouped-query attention sums dK/dV in registers, without atomics (deterministic)."""
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    off_b = (bhk // kv_heads).to(tl.int64)
    off_hk = (bhk % kv_heads).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM
    col_ok = (cols[:, None] < kv_len) & d_ok
    v_col_ok = (cols[:, None] < kv_len) & dv_ok

    k_rows = K + off_b * stride_kb + off_hk * stride_kh + cols[:, None] * stride_kn
    k = tl.load(k_rows + offs_d[None, :] * stride_kd, mask=col_ok, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=v_col_ok, other=0.0)
    q_tile = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    k2, q2_tile, d2_ok, col2_ok = k, q_tile, d_ok, col_ok  # the head dim's second block, where it has one
    dk2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2[None, :] < HEAD_DIM
        col2_ok = (cols[:, None] < kv_len) & d2_ok
        k2 = tl.load(k_rows + offs_d2[None, :] * stride_kd, mask=col2_ok, other=0.0)
        q2_tile = offs_m[:, None] * stride_qm + offs_d2[None, :] * stride_qd
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], dtype=tl.float32)

    diag = kv_len - q_len
    lo = 0
    if IS_CAUSAL:
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M  # first query block that sees a key here
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, lo), BLOCK_M) * BLOCK_M  # sees all keys
        mask_hi = tl.minimum(full_lo, q_len)
    else:
        full_lo = 0
    hi = q_len
    k_doc, doc_row = cols, DOC_START  # the documents' (unused without them)
    if HAS_DOCS:  # one masked run over the queries of the block's documents (an unmasked one costs registers)
        doc_row = DOC_START + off_b * kv_len
        k_doc = tl.load(doc_row + cols, mask=cols < kv_len, other=-1)
        last_col = tl.minimum(start_n + BLOCK_N, kv_len) - 1
        lo, hi = _key_block_span(doc_row, DOC_END + off_b * kv_len, start_n, last_col, lo, q_len, diag, BLOCK_M)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    do_tile = offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod
    for g in range(group):
        off_h = off_hk * group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + q_tile
        q2_ptrs = Q + off_b * stride_qb + off_h * stride_qh + q2_tile
        do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + do_tile
        lse_base = LSE + (off_b * q_heads + off_h) * q_len
        delta_base = DELTA + (off_b * q_heads + off_h) * q_len
        if HAS_DOCS or IS_CAUSAL:
            dk, dk2, dv = _dkdv_run(dk, dk2, dv, k, k2, v, q_ptrs + lo * stride_qm, q2_ptrs + lo * stride_qm,
                                    do_ptrs + lo * stride_dom, stride_qm, stride_dom, lse_base, delta_base, lo,
                                    hi if HAS_DOCS else mask_hi, q_len, diag, qk_scale, cols, offs_m, d_ok, d2_ok,
                                    dv_ok, k_doc, doc_row, BLOCK_M, BLOCK_D2, IS_CAUSAL, HAS_DOCS, True)
        if not HAS_DOCS:
            dk, dk2, dv = _dkdv_run(dk, dk2, dv, k, k2, v, q_ptrs + full_lo * stride_qm, q2_ptrs + full_lo * stride_qm,
                                    do_ptrs + full_lo * stride_dom, stride_qm, stride_dom, lse_base, delta_base,
                                    full_lo, q_len, q_len, diag, qk_scale, cols, offs_m, d_ok, d2_ok, dv_ok, k_doc,
                                    doc_row, BLOCK_M, BLOCK_D2, IS_CAUSAL, HAS_DOCS, False)

    dk_rows = DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dkn
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd
    tl.store(dk_rows + offs_d[None, :] * stride_dkd, (dk * softmax_scale).to(DK.dtype.element_ty), mask=col_ok)
    if BLOCK_D2 > 0:
        tl.store(dk_rows + offs_d2[None, :] * stride_dkd, (dk2 * softmax_scale).to(DK.dtype.element_ty), mask=col2_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=v_col_ok)
