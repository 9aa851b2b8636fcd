"""The Triton kernels behind `step.py` (this module imports triton; `step.py` imports it on first use)."""

import triton
import triton.language as tl


# This program's row, head, key offsets, value offsets and their masks: a [BK, BV] tile of one
# head's [key][value] state.
@triton.jit
def _head_tile(H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    i_bh = tl.program_id(0).to(tl.int64)  # offsets past 2**31 at large B x H x K x V
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    return i_b, i_h, o_k, o_v, m_k, m_v, m_k[:, None] & m_v[None, :]


# A row's head's slice of a [B, H, N] tensor at any strides, as fp32.
@triton.jit
def _head_vector(p, i_b, i_h, s_b, s_h, o, m):
    return tl.load(p + i_b * s_b + i_h * s_h + o, mask=m, other=0.0).to(tl.float32)


@triton.jit
def wkv7_step_kernel(
    r, k, v, w, a, b, s_in, y, s_out,
    H, K, V,
    sr_b, sr_h, sk_b, sk_h, sv_b, sv_h, sw_b, sw_h, sa_b, sa_h, sb_b, sb_h, sy_b, sy_h, ss_b, ss_h, so_b, so_h,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_b, i_h, o_k, o_v, m_k, m_v, m_s = _head_tile(H, K, V, BK, BV)
    b_r = _head_vector(r, i_b, i_h, sr_b, sr_h, o_k, m_k)
    b_k = _head_vector(k, i_b, i_h, sk_b, sk_h, o_k, m_k)
    b_lw = _head_vector(w, i_b, i_h, sw_b, sw_h, o_k, m_k)
    b_a = _head_vector(a, i_b, i_h, sa_b, sa_h, o_k, m_k)
    b_b = _head_vector(b, i_b, i_h, sb_b, sb_h, o_k, m_k)
    b_v = _head_vector(v, i_b, i_h, sv_b, sv_h, o_v, m_v)

    p_s = o_k[:, None] * V + o_v[None, :]  # [key][value] tiles, rows and heads at any stride
    b_s = tl.load(s_in + i_b * ss_b + i_h * ss_h + p_s, mask=m_s, other=0.0)
    # S <- diag(w) S + b (a^T S) + k v^T ; y = S^T r (the state after the update)
    read = tl.sum(b_a[:, None] * b_s, axis=0)
    b_s = tl.exp(b_lw)[:, None] * b_s + b_b[:, None] * read[None, :] + b_k[:, None] * b_v[None, :]
    b_y = tl.sum(b_r[:, None] * b_s, axis=0)
    tl.store(s_out + i_b * so_b + i_h * so_h + p_s, b_s, mask=m_s)
    tl.store(y + i_b * sy_b + i_h * sy_h + o_v, b_y.to(y.dtype.element_ty), mask=m_v)


@triton.jit
def wkv5_step_kernel(
    r, k, v, w, u, s_in, y, s_out,
    H, K, V,
    sr_b, sr_h, sk_b, sk_h, sv_b, sv_h, sw_b, sw_h, su_h, sy_b, sy_h, ss_b, ss_h, so_b, so_h,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_b, i_h, o_k, o_v, m_k, m_v, m_s = _head_tile(H, K, V, BK, BV)
    b_r = _head_vector(r, i_b, i_h, sr_b, sr_h, o_k, m_k)
    b_k = _head_vector(k, i_b, i_h, sk_b, sk_h, o_k, m_k)
    b_lw = _head_vector(w, i_b, i_h, sw_b, sw_h, o_k, m_k)
    b_u = _head_vector(u, 0, i_h, 0, su_h, o_k, m_k)  # the bonus: one per head, for every row
    b_v = _head_vector(v, i_b, i_h, sv_b, sv_h, o_v, m_v)

    p_s = o_k[:, None] * V + o_v[None, :]  # [key][value] tiles, rows and heads at any stride
    b_s = tl.load(s_in + i_b * ss_b + i_h * ss_h + p_s, mask=m_s, other=0.0)
    # y = r^T (u k v^T + S) with the state before the update; S <- diag(w) S + k v^T
    b_kv = b_k[:, None] * b_v[None, :]
    b_y = tl.sum(b_r[:, None] * (b_u[:, None] * b_kv + b_s), axis=0)
    b_s = tl.exp(b_lw)[:, None] * b_s + b_kv
    tl.store(s_out + i_b * so_b + i_h * so_h + p_s, b_s, mask=m_s)
    tl.store(y + i_b * sy_b + i_h * sy_h + o_v, b_y.to(y.dtype.element_ty), mask=m_v)
