"""Triton kernels of FlashAttention-2: forward, the rowsum(dO*O) preprocessing and dQ (dK/dV: in
_flash_attention_dkdv_kernel.py).

Conventions shared by every kernel:
- Tensors are (batch, heads, seq, head_dim) with arbitrary strides; V (hence O, dO and dV) may have
  a head dim of its own (V_DIM, padded to BLOCK_DV), as latent attention's 192 for Q/K and 128 for V; batch and head offsets are
  widened to int64 so that tensors over 2**31 elements address correctly.
- The Q/K head dim is one power-of-two block (BLOCK_D, padded and masked), or two (BLOCK_D2 > 0:
  columns BLOCK_D.. in a second block) where that is less padding: latent attention's 192 is 128 + 64,
  two dot products per tile instead of one over 256 (a quarter of QK^T's work wasted). BLOCK_D2 = 0
  compiles none of the second block's code.
- Causal masking is aligned to the lower right: query i sees key j iff j <= i + (kv_len - q_len),
  as torch.nn.attention.bias.causal_lower_right. Queries that see no key (q_len > kv_len) give a
  zero output and zero gradients; their log-sum-exp is stored as +inf so that the backward's
  exp(s - lse) is 0 for them without a special case.
- Document masking (HAS_DOCS; HAS_DOCS = False compiles none of its code): DOC_START and DOC_END, (batch,
  kv_len) int32 and contiguous, give each key position's document as its first position and one past its
  last; query i is key position i + kv_len - q_len (q_len <= kv_len). A query sees only keys of its own
  document: a query block walks the keys from its first row's document start to its last row's document
  end, a key block's dK/dV the queries likewise, so a tile whose blocks share no document is never
  visited, and every tile walked masks by equal document starts (an unmasked run beside the masked one
  costs registers the kernels do not have: spills in the ahead-of-time report).
- Scores are in base 2: qk_scale = softmax_scale * log2(e), and exp2 replaces exp.
- Without documents, loops are split into blocks that need no masking and blocks that do (sequence
  tails, the causal diagonal), so the common blocks pay for no mask.
- Every load that can leave the tensor is masked, so views into larger buffers are never read
  outside the view.
- Dots take input_precision="ieee": fp32 inputs then get fp32 math like PyTorch's default, not
  TF32; for fp16/bf16 inputs the option changes nothing.
"""

import triton
import triton.language as tl


@triton.jit
def _query_block_span(doc_row, end_row, first, last, hi, BLOCK_N: tl.constexpr):
    """(lo, hi): the key blocks a block of queries at key positions first..last walks under document masking,
    from the one holding its first row's document start to its last row's document end (`hi`: the bound
    without documents). Every key between shares a document with the block."""
    return tl.load(doc_row + first) // BLOCK_N * BLOCK_N, tl.minimum(hi, tl.load(end_row + last))


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, start_n, kv_len, diag, qk_scale, offs_m, offs_n,
    d_ok, d2_ok, dv_ok, q_doc, doc_row,
    BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, MASKED: tl.constexpr,
):
    # The key block from start_n: k_ptrs, k2_ptrs and v_ptrs point at its rows.
    if MASKED:
        cols = start_n + offs_n
        load_ok = (cols[:, None] < kv_len) & d_ok
        v_ok = (cols[:, None] < kv_len) & dv_ok
    else:
        load_ok = d_ok
        v_ok = dv_ok
    k = tl.load(k_ptrs, mask=load_ok, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    if BLOCK_D2 > 0:
        if MASKED:
            k2 = tl.load(k2_ptrs, mask=(cols[:, None] < kv_len) & d2_ok, other=0.0)
        else:
            k2 = tl.load(k2_ptrs, mask=d2_ok, other=0.0)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision="ieee")
    qk = qk * qk_scale
    if MASKED:
        keep = cols[None, :] < kv_len
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
        if HAS_DOCS:
            keep = keep & (q_doc[:, None] == tl.load(doc_row + cols, mask=cols < kv_len, other=-1)[None, :])
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
    return acc, l_i, m_new


@triton.jit
def _fwd_run(
    acc, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, stride_kn, stride_vn,
    lo, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row,
    BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    MASKED: tl.constexpr,
):
    # The key blocks [lo, hi); k_ptrs, k2_ptrs and v_ptrs point at key row `lo` and advance one block per step.
    for start_n in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, start_n, kv_len, diag, qk_scale,
                                  offs_m, offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row,
                                  BLOCK_D2, IS_CAUSAL, HAS_DOCS, MASKED)
        k_ptrs += BLOCK_N * stride_kn
        if BLOCK_D2 > 0:
            k2_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, O, LSE, DOC_START, DOC_END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    q_heads, group, q_len, kv_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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

    q_rows = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm
    k_rows = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=(offs_m[:, None] < q_len) & d_ok, other=0.0)
    k_ptrs = k_rows + offs_d[None, :] * stride_kd
    q2, k2_ptrs, d2_ok = q, k_ptrs, d_ok  # the head dim's second block, where it has one
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2[None, :] < HEAD_DIM
        q2 = tl.load(q_rows + offs_d2[None, :] * stride_qd, mask=(offs_m[:, None] < q_len) & d2_ok, other=0.0)
        k2_ptrs = k_rows + offs_d2[None, :] * stride_kd

    diag = kv_len - q_len
    if IS_CAUSAL:
        hi = tl.minimum(kv_len, start_m + BLOCK_M + diag)  # keys seen by the block's last row
        full_hi = tl.minimum(kv_len, start_m + diag + 1)  # keys seen by all of its rows
    else:
        hi = kv_len
        full_hi = kv_len
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N

    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    # A finite start makes rows that see no key give exp2(-inf - m) = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_DOCS:  # one masked run over the keys of the block's documents (an unmasked one costs registers)
        doc_row = DOC_START + off_b * kv_len
        q_doc = tl.load(doc_row + offs_m + diag, mask=offs_m < q_len, other=-2)
        last = tl.minimum(start_m + BLOCK_M, q_len) - 1 + diag
        lo, hi = _query_block_span(doc_row, DOC_END + off_b * kv_len, start_m + diag, last, hi, BLOCK_N)
        acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, q2, k_ptrs + lo * stride_kn, k2_ptrs + lo * stride_kn,
                                 v_ptrs + lo * stride_vn, stride_kn, stride_vn, lo, hi, kv_len, diag, qk_scale,
                                 offs_m, offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row,
                                 BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, True)
    else:
        acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, q2, k_ptrs, k2_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_hi,
                                 kv_len, diag, qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, offs_m, DOC_START,
                                 BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, False)
        acc, l_i, m_i = _fwd_run(acc, l_i, m_i, q, q2, k_ptrs + full_hi * stride_kn, k2_ptrs + full_hi * stride_kn,
                                 v_ptrs + full_hi * stride_vn, stride_kn, stride_vn, full_hi, hi, kv_len, diag,
                                 qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, offs_m, DOC_START,
                                 BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, True)

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
def _dq_tile(
    dq, dq2, q, q2, do, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, start_n, kv_len, diag, qk_scale, offs_m, offs_n,
    d_ok, d2_ok, dv_ok, q_doc, doc_row,
    BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, MASKED: tl.constexpr,
):
    # The key block from start_n: k_ptrs, k2_ptrs and v_ptrs point at its rows.
    if MASKED:
        cols = start_n + offs_n
        load_ok = (cols[:, None] < kv_len) & d_ok
        v_ok = (cols[:, None] < kv_len) & dv_ok
    else:
        load_ok = d_ok
        v_ok = dv_ok
    k = tl.load(k_ptrs, mask=load_ok, other=0.0)
    v = tl.load(v_ptrs, mask=v_ok, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if BLOCK_D2 > 0:
        if MASKED:
            k2 = tl.load(k2_ptrs, mask=(cols[:, None] < kv_len) & d2_ok, other=0.0)
        else:
            k2 = tl.load(k2_ptrs, mask=d2_ok, other=0.0)
        s = tl.dot(q2, tl.trans(k2), s, input_precision="ieee")
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        # Zero-padded keys past kv_len score 0, and exp2(0 - lse) may overflow: select, never multiply.
        keep = cols[None, :] < kv_len
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
        if HAS_DOCS:
            keep = keep & (q_doc[:, None] == tl.load(doc_row + cols, mask=cols < kv_len, other=-1)[None, :])
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
    if BLOCK_D2 > 0:
        dq2 = tl.dot(ds.to(k2.dtype), k2, dq2, input_precision="ieee")
    return dq, dq2


@triton.jit
def _dq_run(
    dq, dq2, q, q2, do, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, stride_kn, stride_vn,
    lo, hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row,
    BLOCK_N: tl.constexpr, BLOCK_D2: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    MASKED: tl.constexpr,
):
    # The forward's _fwd_run.
    for start_n in range(lo, hi, BLOCK_N):
        dq, dq2 = _dq_tile(dq, dq2, q, q2, do, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, start_n, kv_len, diag, qk_scale,
                           offs_m, offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row, BLOCK_D2, IS_CAUSAL, HAS_DOCS, MASKED)
        k_ptrs += BLOCK_N * stride_kn
        if BLOCK_D2 > 0:
            k2_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq, dq2


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, DQ, LSE, DELTA, DOC_START, DOC_END,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    q_heads, group, q_len, kv_len, qk_scale, softmax_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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

    q_rows = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm
    k_rows = K + off_b * stride_kb + off_hk * stride_kh + offs_n[:, None] * stride_kn
    q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=row_ok, other=0.0)
    k_ptrs = k_rows + offs_d[None, :] * stride_kd
    q2, k2_ptrs, d2_ok, row2_ok = q, k_ptrs, d_ok, row_ok  # the head dim's second block, where it has one
    dq2 = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        d2_ok = offs_d2[None, :] < HEAD_DIM
        row2_ok = (offs_m[:, None] < q_len) & d2_ok
        q2 = tl.load(q_rows + offs_d2[None, :] * stride_qd, mask=row2_ok, other=0.0)
        k2_ptrs = k_rows + offs_d2[None, :] * stride_kd
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], dtype=tl.float32)
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

    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_DOCS:  # the forward's walk
        doc_row = DOC_START + off_b * kv_len
        q_doc = tl.load(doc_row + offs_m + diag, mask=offs_m < q_len, other=-2)
        last = tl.minimum(start_m + BLOCK_M, q_len) - 1 + diag
        lo, hi = _query_block_span(doc_row, DOC_END + off_b * kv_len, start_m + diag, last, hi, BLOCK_N)
        dq, dq2 = _dq_run(dq, dq2, q, q2, do, lse2, delta, k_ptrs + lo * stride_kn, k2_ptrs + lo * stride_kn,
                          v_ptrs + lo * stride_vn, stride_kn, stride_vn, lo, hi, kv_len, diag, qk_scale, offs_m,
                          offs_n, d_ok, d2_ok, dv_ok, q_doc, doc_row, BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, True)
    else:
        dq, dq2 = _dq_run(dq, dq2, q, q2, do, lse2, delta, k_ptrs, k2_ptrs, v_ptrs, stride_kn, stride_vn, 0, full_hi,
                          kv_len, diag, qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, offs_m, DOC_START,
                          BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, False)
        dq, dq2 = _dq_run(dq, dq2, q, q2, do, lse2, delta, k_ptrs + full_hi * stride_kn,
                          k2_ptrs + full_hi * stride_kn, v_ptrs + full_hi * stride_vn, stride_kn, stride_vn, full_hi,
                          hi, kv_len, diag, qk_scale, offs_m, offs_n, d_ok, d2_ok, dv_ok, offs_m, DOC_START,
                          BLOCK_N, BLOCK_D2, IS_CAUSAL, HAS_DOCS, True)
    dq_rows = DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
    tl.store(dq_rows + offs_d[None, :] * stride_dqd, (dq * softmax_scale).to(DQ.dtype.element_ty), mask=row_ok)
    if BLOCK_D2 > 0:
        tl.store(dq_rows + offs_d2[None, :] * stride_dqd, (dq2 * softmax_scale).to(DQ.dtype.element_ty), mask=row2_ok)
