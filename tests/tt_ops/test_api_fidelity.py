"""API-fidelity scan of the project's TT code against the installed ttnn (and a test of the test)."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("ttnn")

from qwen36.tt_ops.api_fidelity import project_files, scan_paths, scan_source  # noqa: E402


def test_project_tt_code_uses_only_real_ttnn_api():
    files = project_files()
    assert any("tt_ops" in str(f) for f in files)
    findings = scan_paths(files)
    assert not findings, "ttnn API misuse:\n" + "\n".join(str(f) for f in findings)


def test_scan_catches_made_up_op_and_kwarg():
    snippet = textwrap.dedent(
        """
        import ttnn

        def layer(ctx, x, w):
            ttnn = ctx.ttnn
            y = ttnn.linear(x, w, memory_config=ttnn.DRAM_MEMORY_CONFIG, compute_kernel_config=None)
            y = ttnn.fused_super_norm(y)                      # made-up op
            y = ttnn.rms_norm(y, eps=1e-6)                    # wrong kwarg (real: epsilon)
            y = ttnn.transformer.paged_update_cache(y)        # wrong namespace (it is experimental)
            z = ctx.ttnn.experimental.paged_update_cache(y, y, update_idxs_tensor=y, page_table=y)
            cfg = ttnn.BlackholeComputeKernelConfig()          # not in 0.81.1
            a = ttnn.add(y, z, **extra)                       # **kwargs: not checkable, not flagged
            b = ttnn.rms_norm(y, 1e-6)                        # epsilon is keyword-only
            return ttnn.MathFidelity.HiFi4, ttnn.MathFidelity.HiFi5
        """
    )
    findings = scan_source(snippet, "synthetic.py")
    text = "\n".join(str(f) for f in findings)
    assert "ttnn.fused_super_norm" in text
    assert "keyword 'eps'" in text
    assert "ttnn.transformer.paged_update_cache" in text
    assert "ttnn.BlackholeComputeKernelConfig" in text
    assert "positional" in text and "ttnn.rms_norm" in text
    assert "ttnn.MathFidelity.HiFi5" in text
    assert "HiFi4" not in text.replace("HiFi4,", "")  # the real enum member is fine
    assert "ttnn.linear" not in text and "paged_update_cache: keyword" not in text
    assert len(findings) == 6, text


def test_scan_ignores_emulator_private_attributes():
    assert scan_source("def f(mesh):\n    return mesh.ttnn._dispatcher\n") == []
    assert [str(f) for f in scan_source("import ttnn\nttnn._no_such_private\n")]


# The API the TT model is written against. Every name must exist in the installed ttnn and
# be reachable through the emulating namespace (golden-backed or emulated - never invented).
CONTRACT = """
as_tensor from_torch to_torch bfloat16 bfloat8_b bfloat4_b float32 uint32 int32 TILE_LAYOUT ROW_MAJOR_LAYOUT
ShardTensorToMesh ReplicateTensorToMesh create_mesh_mapper MeshMapperConfig PlacementShard PlacementReplicate
ConcatMeshToTensor ShardTensor2dMesh ConcatMesh2dToTensor MeshShape DRAM_MEMORY_CONFIG L1_MEMORY_CONFIG
linear matmul WormholeComputeKernelConfig MathFidelity rms_norm add mul multiply subtract sigmoid silu exp softplus
neg reshape permute transpose concat slice typecast to_layout embedding softmax argmax topk sampling all_gather
all_reduce reduce_scatter experimental.all_gather_async experimental.reduce_scatter_minimal_async
transformer.fused_recurrent_gated_delta_rule transformer.chunk_gated_delta_rule
transformer.paged_scaled_dot_product_attention_decode transformer.scaled_dot_product_attention
transformer.scaled_dot_product_attention_decode transformer.chunked_scaled_dot_product_attention
experimental.paged_update_cache experimental.paged_fill_cache experimental.rotary_embedding_llama update_cache
experimental.rotary_embedding_hf experimental.paged_fused_update_cache UnaryOpType experimental.nlp_create_qkv_heads_decode
experimental.indexed_fused_update_cache
experimental.kda.qkv_causal_conv1d_silu experimental.kda.qkv_causal_conv1d_silu_with_carry
experimental.kda.sigmoid_gated_rms_norm QkvCausalConv1dSiluProgramConfig init_device_compute_kernel_config
experimental.kda.prepare_chunk_recurrence experimental.kda.recurrent_chunk_scan experimental.kda.summarize_chunk_recurrence
experimental.kda.affine_exclusive_scan experimental.kda.chain_affine_transforms experimental.kda.reduce_affine_transforms
experimental.kda.select_final_carry
transformer.gated_delta_attn_seq ChunkGdnFusedProgramConfig ChunkGdnPhasedProgramConfig ChunkGdnMonoProgramConfig
fill_cache copy copy_host_to_device_tensor begin_trace_capture end_trace_capture execute_trace release_trace
get_device_tensors deallocate synchronize_device to_device from_device Topology create_global_semaphore
""".split()


def test_contract_names_exist_and_are_reachable():
    import ttnn as real

    from qwen36.tt_ops.device import open_mesh

    with open_mesh("emulated-p150") as ctx:
        for name in CONTRACT:
            r, e = real, ctx.ttnn
            for part in name.split("."):
                r = getattr(r, part)  # AttributeError = the contract names something 0.81.1 lacks
                e = getattr(e, part)
            assert e is not None
    assert not hasattr(real, "BlackholeComputeKernelConfig")  # documented: use WormholeComputeKernelConfig
