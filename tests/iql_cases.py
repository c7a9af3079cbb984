"""The exact-math cases of the IQL GPU tests (tests/test_gpu_iql.py) and sanitizer script (tests/gpu_sanitize_iql.py),
in one place: (G, D, H, B, seed), the networks, input width, hidden width, rows, and the seed of
``test_iql.exact_inputs`` (and of its loss cotangent).

The GPU files take their exact-math cases from these lists, and ``test_iql.py::test_exact_inputs_premise`` checks on
CPU that every case here meets the premise of those tests (no TF32 or float32 rounding can flip a ReLU mask or the
expectile weight: ``test_iql.assert_far_from_kinks``), so a broken premise shows on any machine, not first on the
GPU. A GPU test that builds exact-math inputs takes its (shape, seed) from a list here, and ``EXACT`` names every
list.

Which kernel a case runs (ffi/iql.cu): on compute capability 9.0 (the GPU tests opt in to the kernel path at any B),
H = 128 or 256 with D % 4 == 0 runs jaxfox_iql_fused: 128-row tiles, S = ceil(B / 128) partial rows a network, two
networks a CTA (<2, 2, 1>) where H = 128, G is even and S G / 2 >= 96, else one (<1, 1, 2>; H = 256: <2, 1, 1>).
Every other shape runs the head kernel (blocks a network: S = min(tiles of 32 rows, 264 // G), jaxfox/iql.py); the
notes on tiles and blocks below are the head kernel's where the fused one does not run them.
"""

from __future__ import annotations


def _seeded(shapes, seed):
    """[(G, D, H, B, seed(G, D, H, B), *rest)] for shapes [(G, D, H, B, *rest)]."""
    return [(*s[:4], seed(*s[:4]), *s[4:]) for s in shapes]


# test_exact_math_kernel_matches_oracle: every kernel instance against the float64 oracle
KERNEL_VS_ORACLE = _seeded([
    (2, 256, 128, 16384),  # the aux trainers' shape: fused, two networks a CTA, 128 tiles (128 partial rows)
    (2, 256, 128, 37),     # fused, one network a CTA: one tile, partial (37 rows)
    (1, 64, 64, 1),        # B = 1: one tile of one row; lanes 16..31 hold no column (H = 64)
    (3, 128, 64, 1000),    # G = 3 (32 blocks a network), partial last tile (1000 = 31 x 32 + 8)
    (2, 128, 128, 4097),   # fused, one network a CTA: 33 tiles (S = 33 < 96), partial last tile (1 row)
    (1, 256, 64, 5000),    # G = 1: 157 blocks, 157 partial rows (the finish kernel's rows 0..28 take 5 each)
    (2, 64, 128, 100),     # D = 64, H = 128 (fused, one network a CTA, one partial tile)
    (2, 48, 132, 300),     # H = 132: two column chunks a lane (the kernel's KH = 2), the second only on lane 0
    (2, 48, 300, 300),     # H = 300: three column chunks a lane (KH = 3), the third on lanes 0..10
    (1, 32, 512, 70),      # H = 512: four column chunks a lane (KH = 4), the widest
    (2, 64, 256, 300),     # fused at H = 256 for a second network (CTA row y = 1); 3 tiles, the last 44 rows
    (2, 254, 128, 4097),   # D % 4 != 0: the head kernel at H = 128 on sm_90 too, 129 tiles over 129 blocks
    (2, 254, 128, 16384),  # the head kernel at the aux shape on sm_90 too: 512 tiles over 132 blocks (grid stride)
], lambda G, D, H, B: G + B)

# test_exact_math_reference_matches_oracle: XLA's TF32 path on the same GPU meets the tolerance too
REFERENCE_VS_ORACLE = _seeded([(2, 256, 128, 37), (3, 128, 64, 1000), (2, 256, 128, 16384)],
                              lambda G, D, H, B: G + B)

# test_grad_of_params_only_matches_oracle (its "exact" regime)
PARAMS_ONLY = [(2, 256, 128, 10000, 9)]

# test_dobs_and_dtarget_match_oracle; B = 12289: two networks a CTA (97 tiles)
DOBS_DTARGET = _seeded([(2, 256, 128, 4097), (2, 256, 128, 12289), (3, 128, 64, 37), (1, 64, 64, 1)],
                       lambda G, D, H, B: 11 + B)

# test_dtarget_is_per_row
DTARGET_PER_ROW = [(2, 256, 128, 37, 12)]

# test_vmap_matches_per_instance_calls: V = 3 instances (seeds 20, 21, 22) at each H; H = 64 runs the head kernel,
# H = 128 on compute capability 9.0 the fused one
VMAP = [(2, 128, H, 100, 20 + v) for H in (64, 128) for v in range(3)]

# test_shapes_outside_the_kernel_run_the_reference: H not a multiple of 4, or above 512
OUTSIDE_THE_KERNEL = [(2, 32, 6, 50, 17), (2, 16, 516, 40, 17)]

# test_exact_inputs_reach_every_mask_kind: the aux trainers' shape
MASK_KINDS = _seeded([(2, 256, 128, 16384)], lambda G, D, H, B: G + B)

# test_fused_kernel_where_it_applies: (G, D, H, B, seed, fused), fused meaning on compute capability 9.0
FUSED_WHERE_IT_APPLIES = _seeded([
    (2, 256, 128, 16384, True),   # the aux trainers' shape: 128 tiles of 128 rows a network
    (1, 100, 256, 300, True),     # H = 256 (two 128-column products a k-step), D = 100: the last K chunk 4 of 32
    (3, 36, 128, 129, True),      # G = 3, D = 36 (2 chunks, the second 4 floats), 2 tiles, the last one 1 row
    (4, 36, 128, 129, True),      # G = 4 with 4 network-pair CTAs (< 96, ffi/iql.cu IqlFusedImpl): one network a CTA
    (4, 36, 128, 6145, True),     # G = 4, 98 pair CTAs: two networks a CTA (networks 2 y, 2 y + 1), CTA row y = 1 too
    (2, 256, 64, 100, False),     # H = 64: head kernel
    (2, 48, 132, 300, False),     # H = 132: head kernel
    (2, 30, 128, 50, False),      # D = 30, not a multiple of 4: head kernel
], lambda G, D, H, B: G + D + H + B)

# test_two_networks_a_cta_give_the_bits_of_one: G = 4 (two networks a CTA), and its first three networks as G = 3
TWO_NETWORKS_A_CTA = [(4, 256, 128, 6145, 48)]

# test_default_path_by_batch: (G, D, H, B, seed, fused), without the opt-in: the fused kernel from B = 4096 on
DEFAULT_PATH_BY_BATCH = _seeded([(2, 256, 128, 2048, False), (2, 256, 128, 4095, False), (2, 256, 128, 4096, True)],
                                lambda G, D, H, B: B)

# test_highest_precision_takes_the_head_path
HIGHEST_PRECISION = _seeded([(2, 256, 128, 4097)], lambda G, D, H, B: G + B)

# gpu_sanitize_iql.py, each case run once under memcheck and racecheck. On sm_90 the cases of H = 128 or 256 with
# D % 4 == 0 run the fused kernel (the script opts in to ``iql``, which keeps it below B = 4096); the rest the head
# kernel. The tile notes of (2, 256, 128, 37) and (2, 128, 128, 4097) describe the head kernel, which runs them only
# on other devices; (2, 254, 128, 4097) keeps them on sm_90.
SANITIZE = _seeded([
    (2, 256, 128, 37),    # the aux trainers' network shape, 2 tiles of 32 rows, the last one partial (5 rows)
    (1, 64, 64, 5),       # B < 32, one partial tile, H < 128 (lanes 16..31 hold no column)
    (3, 128, 64, 1000),   # G = 3 (grid 32 x 3), 32 tiles, the last one partial (8 rows)
    (2, 128, 128, 4097),  # 129 tiles over 129 blocks a network, the last tile 1 row; the finish kernel sums 129
    #                       partial rows a column (its thread row 0 takes 5 of them, the others 4) over 2 x 260
    #                       columns (17 blocks, the last partial)
    (2, 48, 132, 300),    # H = 132, two column chunks a lane (the second only on lane 0)
    (1, 32, 512, 70),     # H = 512, the widest (four column chunks a lane), 1028 partial-row columns (the last
    #                       finish block takes 4 of its 32)
    (1, 100, 256, 300),   # on sm_90 the fused kernel at H = 256 (two 128-column products a k-step), D = 100 (its
    #                       last 32-float K chunk holds 4 floats, the rest zero-filled), 3 tiles of 128 rows, the
    #                       last one 44
    (3, 36, 128, 129),    # on sm_90 the fused kernel for G = 3, D = 36 (2 K chunks), 2 tiles, the last one 1 row
    (4, 36, 128, 129),    # G even with 2 x 2 = 4 network-pair CTAs, fewer than IqlFusedImpl's 96: one network a CTA
    (4, 36, 128, 6145),   # two networks a CTA (49 tiles x 2 pairs = 98 CTAs), the second pair in CTA row y = 1, the
    #                       last tile 1 row
    (2, 64, 256, 300),    # on sm_90 the fused kernel at H = 256 for a second network (CTA row y = 1, columns g H on)
    (2, 254, 128, 4097),  # D not a multiple of 4, so the head kernel at H = 128 also on sm_90: 129 tiles over 129
    #                       blocks a network, and the finish kernel's 129 partial rows a column as above
    (3, 128, 64, 4000),   # the head kernel walking several tiles a block (125 tiles over 88 blocks a network)
], lambda G, D, H, B: G + D + H + B)

EXACT = {
    "KERNEL_VS_ORACLE": KERNEL_VS_ORACLE, "REFERENCE_VS_ORACLE": REFERENCE_VS_ORACLE, "PARAMS_ONLY": PARAMS_ONLY,
    "DOBS_DTARGET": DOBS_DTARGET, "DTARGET_PER_ROW": DTARGET_PER_ROW, "VMAP": VMAP,
    "OUTSIDE_THE_KERNEL": OUTSIDE_THE_KERNEL, "MASK_KINDS": MASK_KINDS,
    "FUSED_WHERE_IT_APPLIES": FUSED_WHERE_IT_APPLIES, "TWO_NETWORKS_A_CTA": TWO_NETWORKS_A_CTA,
    "DEFAULT_PATH_BY_BATCH": DEFAULT_PATH_BY_BATCH, "HIGHEST_PRECISION": HIGHEST_PRECISION, "SANITIZE": SANITIZE,
}
