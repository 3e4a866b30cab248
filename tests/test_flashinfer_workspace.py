"""flashinfer's workspace bound against the sizes its planner asked for on an H100 (132 SMs), where the
fixed 128 MiB workspace failed (docs/benchmarks.md, 2026-12-08)."""

from rollout.attention.flashinfer_workspace import MIN_BYTES, cta_tile_q, split_kv_bytes, workspace_bytes

H100_SMS = 132


def test_the_graph_bound_is_the_size_the_planner_asked_for():
    # Qwen3-30B-A3B, a decode graph of 512: "batch_prefill_tmp_v with size 201064448"; tmp_s beside it
    tmp_v, tmp_s = 201_064_448, 201_064_448 // 128
    assert split_kv_bytes(32, 4, 128, H100_SMS, graph_batch=512) == tmp_v + tmp_s
    assert workspace_bytes(32, 4, 128, H100_SMS, graph_batch=512) > tmp_v + tmp_s


def test_the_eager_bound_covers_the_prefill_that_overflowed():
    # a 1500-token prefill of that shape took tmp_v = 128 MiB (64 tiles of 128 rows), then tmp_s of 1 MiB
    # found no room: the bound covers both and exceeds the old fixed size
    need = 32 * 64 * 128 * 4 * (128 + 1)
    assert split_kv_bytes(32, 4, 128, H100_SMS) >= need
    assert workspace_bytes(32, 4, 128, H100_SMS) > MIN_BYTES


def test_small_models_keep_the_old_size_and_tiles_follow_flashinfer():
    assert workspace_bytes(14, 2, 64, H100_SMS, graph_batch=256) == MIN_BYTES  # Qwen2.5-0.5B
    assert [cta_tile_q(n, 128) for n in (1, 16, 17, 64, 65)] == [16, 16, 64, 64, 128]
    assert cta_tile_q(65, 256) == 64  # head_dim 256 never takes 128-row tiles
    # grows with the graph batch, never below the eager bound
    sizes = [workspace_bytes(28, 4, 128, H100_SMS, graph_batch=b) for b in (0, 64, 256, 512, 1024)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
