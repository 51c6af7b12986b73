"""Triton kernels of FlashAttention-2: forward, the rowsum(dO*O) preprocessing, dK/dV and dQ.

Conventions shared by every kernel:
- Tensors are (batch, heads, seq, head_dim) with arbitrary strides; V (hence O, dO and dV) may have
  a head dim of its own (V_DIM, padded to BLOCK_DV), as latent attention's 192 for Q/K and 128 for V; batch and head offsets are
  widened to int64 so that tensors over 2**31 elements address correctly.
- Causal masking is aligned to the lower right: query i sees key j iff j <= i + (kv_len - q_len),
  as torch.nn.attention.bias.causal_lower_right. Queries that see no key (q_len > kv_len) give a
  zero output and zero gradients; their log-sum-exp is stored as +inf so that the backward's
  exp(s - lse) is 0 for them without a special case.
- Scores are in base 2: qk_scale = softmax_scale * log2(e), and exp2 replaces exp.
- Loops are split into blocks that need no masking and blocks that do (sequence tails, the
  causal diagonal), so the common blocks pay for no mask.
- Every load that can leave the tensor is masked, so views into larger buffers are never read
  outside the view.
- Dots take input_precision="ieee": fp32 inputs then get fp32 math like PyTorch's default, not
  TF32; for fp16/bf16 inputs the option changes nothing.
"""

import triton
import triton.language as tl


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, step_k, step_v,
    lo, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
):
    # k_ptrs and v_ptrs point at key row `lo` and advance one block per step.
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            load_ok = (cols[:, None] < kv_len) & d_ok
            v_ok = (cols[:, None] < kv_len) & dv_ok
        else:
            load_ok = d_ok
            v_ok = dv_ok
        k = tl.load(k_ptrs, mask=load_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        if MASKED:
            keep = cols[None, :] < kv_len
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=v_ok, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
        k_ptrs += step_k
        v_ptrs += step_v
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    q_heads, group, q_len, kv_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off_b = (bh // q_heads).to(tl.int64)
    off_h = (bh % q_heads).to(tl.int64)
    off_hk = off_h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM

    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < q_len) & d_ok, other=0.0)

    diag = kv_len - q_len
    if IS_CAUSAL:
        hi = tl.minimum(kv_len, start_m + BLOCK_M + diag)  # keys seen by the block's last row
        full_hi = tl.minimum(kv_len, start_m + diag + 1)  # keys seen by all of its rows
    else:
        hi = kv_len
        full_hi = kv_len
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N

    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    # A finite start makes rows that see no key give exp2(-inf - m) = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, BLOCK_N * stride_kn, BLOCK_N * stride_vn,
                               0, full_hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok,
                               BLOCK_N, IS_CAUSAL, False)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs + full_hi * stride_kn, v_ptrs + full_hi * stride_vn,
                               BLOCK_N * stride_kn, BLOCK_N * stride_vn,
                               full_hi, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok,
                               BLOCK_N, IS_CAUSAL, True)

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("inf"))
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=(offs_m[:, None] < q_len) & dv_ok)
    tl.store(LSE + bh.to(tl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def attn_bwd_delta(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    q_heads, q_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    off_b = (bh // q_heads).to(tl.int64)
    off_h = (bh % q_heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * q_len + offs_m, delta, mask=offs_m < q_len)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_base, delta_base, step_q, step_do,
    lo, hi, q_len, diag, qk_scale, cols, offs_m, d_ok, dv_ok,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
):
    # Works on transposed scores (keys x queries) so that dK and dV accumulate along rows.
    # q_ptrs and do_ptrs point at query row `lo`.
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < q_len
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok, other=0.0)
        # Rows past q_len get lse = +inf, hence p = 0, so they add nothing.
        lse2 = tl.load(lse_base + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision="ieee") * qk_scale - lse2[None, :])
        if MASKED:
            p_t = tl.where(cols[:, None] <= rows[None, :] + diag, p_t, 0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None] & dv_ok, other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
        delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
        q_ptrs += step_q
        do_ptrs += step_do
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    q_heads, kv_heads, group, q_len, kv_len, qk_scale, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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

    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok, other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=v_col_ok, other=0.0)

    diag = kv_len - q_len
    if IS_CAUSAL:
        lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M  # first query block that sees a key here
        full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, lo), BLOCK_M) * BLOCK_M  # sees all keys
        mask_hi = tl.minimum(full_lo, q_len)
    else:
        full_lo = 0

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    q_tile = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_tile = offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod
    for g in range(group):
        off_h = off_hk * group + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + q_tile
        do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + do_tile
        lse_base = LSE + (off_b * q_heads + off_h) * q_len
        delta_base = DELTA + (off_b * q_heads + off_h) * q_len
        if IS_CAUSAL:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs + lo * stride_qm, do_ptrs + lo * stride_dom,
                                     lse_base, delta_base, BLOCK_M * stride_qm, BLOCK_M * stride_dom,
                                     lo, mask_hi, q_len, diag, qk_scale, cols, offs_m, d_ok, dv_ok, BLOCK_M, True)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs + full_lo * stride_qm, do_ptrs + full_lo * stride_dom,
                                 lse_base, delta_base, BLOCK_M * stride_qm, BLOCK_M * stride_dom,
                                 full_lo, q_len, q_len, diag, qk_scale, cols, offs_m, d_ok, dv_ok, BLOCK_M, False)

    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + cols[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd
    tl.store(dk_ptrs, (dk * softmax_scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=v_col_ok)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, step_k, step_v,
    lo, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASKED: tl.constexpr,
):
    # k_ptrs and v_ptrs point at key row `lo`.
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            cols = start_n + offs_n
            load_ok = (cols[:, None] < kv_len) & d_ok
            v_ok = (cols[:, None] < kv_len) & dv_ok
        else:
            load_ok = d_ok
            v_ok = dv_ok
        k = tl.load(k_ptrs, mask=load_ok, other=0.0)
        v = tl.load(v_ptrs, mask=v_ok, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale - lse2[:, None])
        if MASKED:
            # Zero-padded keys past kv_len score 0, and exp2(0 - lse) may overflow: select, never multiply.
            keep = cols[None, :] < kv_len
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        k_ptrs += step_k
        v_ptrs += step_v
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, DQ, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    q_heads, group, q_len, kv_len, qk_scale, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query block, query head, batch), walking the keys like the forward."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off_b = (bh // q_heads).to(tl.int64)
    off_h = (bh % q_heads).to(tl.int64)
    off_hk = off_h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < HEAD_DIM
    dv_ok = offs_dv[None, :] < V_DIM
    row_ok = (offs_m[:, None] < q_len) & d_ok

    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=(offs_m[:, None] < q_len) & dv_ok, other=0.0)
    row_base = bh.to(tl.int64) * q_len
    lse2 = tl.load(LSE + row_base + offs_m, mask=offs_m < q_len, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < q_len, other=0.0)

    diag = kv_len - q_len
    if IS_CAUSAL:
        hi = tl.minimum(kv_len, start_m + BLOCK_M + diag)
        full_hi = tl.minimum(kv_len, start_m + diag + 1)
    else:
        hi = kv_len
        full_hi = kv_len
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N

    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs, v_ptrs, BLOCK_N * stride_kn, BLOCK_N * stride_vn,
                       0, full_hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok, BLOCK_N, IS_CAUSAL, False)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_ptrs + full_hi * stride_kn, v_ptrs + full_hi * stride_vn,
                       BLOCK_N * stride_kn, BLOCK_N * stride_vn,
                       full_hi, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, dv_ok, BLOCK_N, IS_CAUSAL, True)
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    tl.store(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok)
