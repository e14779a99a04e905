"""An independent float64 NumPy implementation of QED, written from the paper's matrix form.

Per token: ``S_t = M_t D_t S_{t-1} + k_t (w_t v_t)^T`` with ``M_t = I - k_t a_t^T``,
``D_t = Diag(exp g_t)`` and ``o_t = S_t^T (scale q_t)``; directions use the explicit
projector ``P_t = I - k_t k_t^T``. Used only as a test oracle for ``qed_naive``.
"""
import numpy as np


def _unit(x):
    return x / np.sqrt(x @ x + 1e-6)


def _direction(arm, q, k, b, z):
    P = np.eye(len(k)) - np.outer(k, k)
    return {
        "gdn2": np.zeros_like(q),
        "nogate_noproj": q,
        "nogate": P @ q,
        "full": P @ np.diag(b) @ q,
        "rand": P @ np.diag(b) @ z if z is not None else None,
        "noproj": np.diag(b) @ q,
    }[arm]


def independent_qed(q, k, v, g, b, w, lam, arm, z=None, scale=None, state=None):
    """One sequence: q,k,g,b [T,H,K]; v,w [T,H,V]; lam [T,H]; z [H,K]; state [H,K,V]."""
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = np.zeros((H, K, V)) if state is None else state.copy()
    o = np.zeros((T, H, V))
    for t in range(T):
        for h in range(H):
            qh, kh = _unit(q[t, h]), _unit(k[t, h])
            d = _direction(arm, qh, kh, b[t, h], None if z is None else z[h])
            a = b[t, h] * kh + lam[t, h] * d
            M = np.eye(K) - np.outer(kh, a)
            S[h] = M @ np.diag(np.exp(g[t, h])) @ S[h] + np.outer(kh, w[t, h] * v[t, h])
            o[t, h] = S[h].T @ (scale * qh)
    return o, S
