"""The ledger of claims: each thing the README and the docs say is proven, on the page that
says it, with the tests that prove it. `scripts/update_docs.py` renders it as
docs/proofs.md; tests/test_proofs.py fails when a claim has no test, when a test named
here is gone, or when a page names a test file that no claim lists.

A test is `FILE::FUNCTION` or `FILE::FUNCTION[ID]` (one case of a parametrized test)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    page: str  # where the claim is made: README.md or docs/NAME.md
    says: str  # the claim, as a user reads it
    tests: tuple[str, ...]  # what proves it


E, P = "test_equivalence.py::test_strategy_equals_one_device", "test_pipeline.py"
CTX = "test_context.py::test_a_context_layout_trains_as_one_device"

CLAIMS = (
    # README: What is proven
    Claim("README.md", "Data parallel with ZeRO-0 equals one device", (f"{E}[dp8-zero0]",)),
    Claim(
        "README.md",
        "ZeRO-1 (optimizer state split) equals one device, its state the ZeRO formula's",
        (f"{E}[dp8-zero1]", "test_ledger.py::test_state_bytes_match_zero_formula"),
    ),
    Claim(
        "README.md",
        "ZeRO-2 (gradients reduce-scattered) equals one device, at the textbook bytes",
        (f"{E}[dp8-zero2]", "test_ledger.py::test_zero12_reduce_scatter_not_all_reduce"),
    ),
    Claim(
        "README.md",
        "ZeRO-3 (parameters gathered by layer) equals one device, its state the formula's",
        (f"{E}[dp8-zero3]", "test_ledger.py::test_zero3_gathers_again_for_backward"),
    ),
    Claim(
        "README.md",
        "Megatron tensor parallel equals one device, at the textbook bytes",
        (f"{E}[tp8]", "test_ledger.py::test_comm_at_textbook_minimum"),
    ),
    Claim("README.md", "data x tensor x ZeRO-3 equals one device", (f"{E}[dp4-tp2-zero3]",)),
    Claim(
        "docs/how-it-works.md",
        "Every data-parallel layout's wire bytes are within 1.00-1.02 x the textbook minimum",
        ("test_minimum.py::test_ratio_to_the_minimum",),
    ),
    Claim(
        "README.md",
        "GPipe, 1F1B and interleaved pipelines equal one device",
        (f"{P}::test_schedule_equals_one_device",),
    ),
    Claim(
        "README.md",
        "The compiled pipeline's bubble (idle compute over all, each op weighed by its "
        "work) is its table's and its formula's (ZB-H1's: at most its bound), and "
        "interleaving shrinks it",
        (
            f"{P}::test_compiled_bubble_matches_formula",
            f"{P}::test_idle_share_of_the_tick_table_is_the_textbook_bubble",
            f"{P}::test_interleaving_shrinks_the_bubble",
        ),
    ),
    Claim(
        "README.md",
        "The hand-written ring all-reduce and the gradient server train as XLA's all-reduce, "
        "at the textbook bytes",
        (
            "test_dp.py::test_ring_and_server_train_like_xla",
            "test_dp.py::test_ring_wire_bytes_are_the_textbook_all_reduce",
            "test_dp.py::test_server_carries_n_times_a_ring_devices_traffic",
        ),
    ),
    Claim(
        "README.md",
        "ZeRO groups across hosts (replica) equal one device, each axis at its minimum",
        (
            "test_replica.py::test_replicas_of_zero_groups_equal_one_device",
            "test_replica.py::test_each_axis_at_its_minimum",
        ),
    ),
    Claim(
        "README.md",
        "ZeRO-Offload trains as without offload, its optimizer state on the host",
        (
            "test_offload.py::test_offload_trains_like_no_offload",
            "test_offload.py::test_optimizer_state_lives_on_the_host",
        ),
    ),
    Claim(
        "README.md",
        "Context parallelism (all_gather and Ulysses) equals one device at the textbook bytes",
        (CTX, "test_context.py::test_context_bytes_are_the_textbook_minimum"),
    ),
    Claim(
        "README.md",
        "Expert parallelism equals one device at the textbook bytes",
        (
            "test_moe.py::test_a_mixture_trains_in_every_layout_as_on_one_device",
            "test_moe.py::test_the_expert_axis_moves_the_textbook_bytes",
        ),
    ),
    Claim(
        "README.md",
        "A run killed with kill -9 resumes bitwise to the run that was never stopped",
        (
            "test_checkpoint.py::test_kill_9_where_it_can_hurt_resumes_to_the_straight_run",
            "test_checkpoint.py::test_resume_is_bit_identical",
        ),
    ),
    Claim(
        "docs/checkpoints.md",
        "A local tier takes the frequent saves, and a run resumes from the newer tier; with "
        "a folder of each host's own, from the newest step every process holds",
        (
            "test_checkpoint.py::test_a_local_tier_takes_the_frequent_saves_and_a_resume_reads_the_newer",
            "test_distributed.py::test_a_local_tier_two_processes_write_is_one_checkpoint_or_each_its_own",
        ),
    ),
    Claim(
        "README.md",
        "A checkpoint restores into any other layout",
        (
            "test_checkpoint.py::test_restore_into_another_layout",
            "test_moe.py::test_a_checkpoint_restores_into_another_expert_degree",
        ),
    ),
    Claim(
        "README.md",
        "Many processes (jax.distributed, gloo) equal one",
        ("test_distributed.py::test_two_processes_train_like_one",),
    ),
    Claim(
        "README.md",
        "Every hand-written collective equals its jax.lax twin on integers",
        (
            "test_collectives.py::test_equals_lax_twin_on_integers",
            "test_collectives.py::test_gradients_equal_the_twins",
            "test_dp.py::test_reduce_equals_psum_and_psum_scatter_on_integers",
        ),
    ),
    Claim(
        "README.md",
        "Hugging Face checkpoints load and export with transformers' logits (Llama, Mistral, "
        "Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, Gemma 2 and 3)",
        (
            "test_hf.py::test_loaded_weights_give_transformers_logits_in_every_layout",
            "test_hf.py::test_train_export_and_load_in_transformers",
            "test_families.py::test_trained_and_exported_logits_are_transformers_logits",
            "test_mixtral.py::test_trained_and_exported_logits_are_transformers_logits",
            "test_deepseek.py::test_trained_and_exported_logits_are_transformers_logits",
            "test_gemma.py::test_trained_and_exported_logits_are_transformers_logits",
        ),
    ),
    Claim(
        "README.md",
        "jaxpar generate continues exactly as transformers.generate",
        ("test_generate.py::test_greedy_equals_transformers_generate",),
    ),
    Claim(
        "README.md",
        "Generation is measured against transformers.generate by jaxpar bench",
        ("test_bench.py::test_generate_section_reports_speeds_and_the_cache_against_its_formula",),
    ),
    Claim(
        "README.md",
        "jaxpar eval answers lm-eval's requests as its hf backend, in every decoding layout",
        ("test_lm_eval.py::test_every_request_equals_lm_evals_hf_backend",),
    ),
    Claim(
        "README.md",
        "A bad configuration exits 2 with one line naming the key, the numbers and the fix",
        (
            "test_bad_input.py::test_override_refused",
            "test_bad_input.py::test_every_subcommand_uses_the_same_checker",
            "test_bad_input.py::test_refused_by_the_installed_command_before_jax_starts",
        ),
    ),
    Claim(
        "README.md",
        "The set-up commands, the tour and the walk-through run as written",
        (
            "test_docs.py::test_the_walk_through_and_the_tour_run_as_written",
            "test_docs.py::test_every_command_the_docs_show_parses",
        ),
    ),
    Claim(
        "README.md",
        "The default job (3D, ZeRO-1, 1F1B) equals one device",
        ("test_equivalence.py::test_default_job_equals_one_device",),
    ),
    # docs/running.md
    Claim(
        "docs/running.md",
        "The run directory holds metrics.jsonl, loss.png, summary.json and step.hlo.txt",
        ("test_cli.py::test_train_writes_run_directory",),
    ),
    Claim(
        "docs/running.md",
        "Every invalid key, path and number is refused the same way by every subcommand",
        (
            "test_bad_input.py::test_subcommand_paths_and_numbers_refused",
            "test_bad_input.py::test_the_ranges_are_the_reviewed_ones",
            "test_bad_commands.py::test_every_numeric_flag_of_generate_has_a_range",
        ),
    ),
    Claim(
        "docs/running.md",
        "TensorBoard events, MFU and throughput are written beside metrics.jsonl",
        (
            "test_observe.py::test_tensorboard_events_hold_every_tag_per_step",
            "test_observe.py::test_mfu_and_throughput_in_rows_and_summary",
        ),
    ),
    Claim(
        "docs/running.md",
        "train.check_replicas_every stops a run whose copies differ, naming them",
        ("test_replica_check.py::test_a_corrupted_replica_stops_the_run_naming_it",),
    ),
    # docs/layouts.md
    Claim(
        "docs/layouts.md",
        "ZB-H1 (each backward split into B and W, W recomputing nothing) equals one device "
        "at p=2 and p=4, with padded stages, and over data x tensor x ZeRO-3",
        (
            f"{P}::test_schedule_equals_one_device[zb-h1-p2-m4]",
            f"{P}::test_schedule_equals_one_device[zb-h1-p4-m8-6layers]",
            f"{P}::test_schedule_equals_one_device[3d-zero3-zb-h1-m2]",
            f"{P}::test_the_split_backward_is_autodiffs_and_w_recomputes_nothing",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "W's slot holds each weight product's input and output gradient; a norm's scale "
        "and bias gradients are made in B, so W keeps no normalized input for them",
        (f"{P}::test_w_keeps_its_products_operands_and_a_norms_gradients_come_from_b",),
    ),
    Claim(
        "docs/layouts.md",
        "ZBV (two chunks a device in a V) equals one device at p=2 and p=4 (m = p and 2p), "
        "with padded chunks, over data x tensor x ZeRO-3, with experts, with packed "
        "documents, in its evaluation, and moves its checkpoint into 1F1B's stages",
        (
            f"{P}::test_schedule_equals_one_device[zbv-p2-m4]",
            f"{P}::test_schedule_equals_one_device[zbv-p4-m4-10layers]",
            f"{P}::test_schedule_equals_one_device[3d-zero3-zbv-m2]",
            "test_moe.py::test_a_mixture_trains_in_every_layout_as_on_one_device"
            "[pp2-expert2-tp2-zbv-m2]",
            "test_documents.py::test_a_masked_loss_is_the_same_in_every_layout[zbv-micro2]",
            "test_eval.py::test_held_out_loss_is_the_same_under_every_layout[zbv]",
            "test_checkpoint.py::test_restore_into_another_layout[zbv -> 1f1b]",
            f"{P}::test_a_v_holds_the_first_and_the_last_chunk_on_device_0",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "ZBV's table runs each F, R, B and W of both chunks once after its inputs, idles "
        "the paper's (p-1)(F+B-2W) (1 - 8m/(8m+p-1)) and nowhere in its steady state, "
        "under ZB-H1's bubble / 2 at p=4, m=8; a V too deep for the model is refused",
        (
            f"{P}::test_zbv_table_runs_each_op_of_both_chunks_once_and_idles_only_to_fill_and_drain",
            f"{P}::test_a_broken_tick_table_is_refused",
            f"{P}::test_a_hand_built_parts_without_a_layer_refuses_zb_h1_alone",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "DualPipeV (a forward beside another micro-batch's backward on one tick, in a V) "
        "equals one device at p=2 and p=4 (m = 2p and 4p), with padded chunks, over data "
        "x tensor x ZeRO-3, with experts and with packed documents; its hand-over of a "
        "pair's gradient is what makes it so",
        (
            f"{P}::test_schedule_equals_one_device[dualpipev-p2-m4]",
            f"{P}::test_schedule_equals_one_device[dualpipev-p4-m8-10layers]",
            f"{P}::test_schedule_equals_one_device[3d-zero3-dualpipev-m8]",
            "test_moe.py::test_a_mixture_trains_in_every_layout_as_on_one_device"
            "[pp2-expert2-tp2-dualpipev-m4]",
            "test_documents.py::test_a_masked_loss_is_the_same_in_every_layout[dualpipev-micro4]",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "DualPipeV's table is DeepSeek's order: each F, R, B and W of both chunks once "
        "after its inputs, its pairs where DualPipeV overlaps, no idle in the steady state; "
        "fewer than 2p micro-batches refused; the compiled loop runs its table",
        (
            f"{P}::test_dualpipev_table_pairs_forwards_with_backwards_and_idles_only_to_fill_and_drain",
            f"{P}::test_a_broken_tick_table_is_refused",
            f"{P}::test_compiled_bubble_matches_formula[dualpipev-1-8]",
            "test_bad_input.py::test_override_refused[combination-dualpipev-m]",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "ZB-H1's table runs every F, R, B and W once after its inputs, holds at most "
        "1F1B's p micro-batches in flight, one chunk's residuals and one W slot, and idles "
        "the paper's (p-1)(F+B-W), at most 1F1B's bubble / 2.5 at p=4, m=8; a broken table "
        "is refused; its temporaries (and ZBV's and DualPipeV's) stay flat in m, over "
        "1F1B's by no more than their W slots and within 1.1x 1F1B's at p=2, m=8; R's slot "
        "keeps only what B cannot make again by elementwise steps; the planner counts "
        "each table's slots",
        (
            f"{P}::test_zb_h1_table_runs_each_f_r_b_and_w_once_after_its_inputs",
            f"{P}::test_a_broken_tick_table_is_refused",
            f"{P}::test_1f1b_and_zb_h1_keep_fewer_activations_than_gpipe",
            f"{P}::test_the_planners_slot_counts_are_the_tables",
            f"{P}::test_the_split_backward_is_autodiffs_and_w_recomputes_nothing",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "Muon's update equals optax.contrib.muon's with the same per-matrix split; each leaf "
        "is in the group its kind asks for",
        (
            "test_muon.py::test_muon_equals_optax_contrib_muon",
            "test_muon.py::test_each_leaf_is_in_the_group_its_kind_asks_for",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "Muon in every layout equals one device; the owners' all-to-alls and the Gram "
        "products' all-reduces (on ZeRO's shards, over tensor) are at their minimum",
        (
            "test_muon.py::test_every_layout_equals_one_device",
            "test_muon.py::test_newton_schulz_moves_its_paths_least_bytes",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "QK-clip scales each head whose largest logit passed tau back by tau / max (latent "
        "attention by its parts), no other weight; over data x tensor x ZeRO-3, over "
        "context (all_gather and Ulysses), through a pipeline's stages (1F1B, "
        "interleaved, ZB-H1) and offloaded to the host it equals one device; under "
        "parameter averaging each copy is clipped by its own rows",
        (
            "test_muon.py::test_qk_clip_scales_each_head_over_tau_back_and_no_other",
            "test_muon.py::test_every_layout_equals_one_device",
            "test_muon.py::test_qk_clip_where_no_logit_comes_out_is_one_line",
            "test_muon.py::test_qk_clip_under_parameter_averaging_clips_each_copy_by_its_own_rows",
            "test_muon.py::test_the_attention_forms_hand_on_each_heads_largest_logit",
            "test_muon.py::test_qk_clip_leaves_a_frozen_copys_attention_alone",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "Newton-Schulz's FLOPs, as the planner and inspect count them, are XLA's within 1%",
        ("test_muon.py::test_newton_schulz_flops_are_xlas_and_the_owners_split_them",),
    ),
    Claim(
        "docs/layouts.md",
        "A Muon run resumes bit for bit and trains on in another layout; DPO and GRPO take it",
        (
            "test_checkpoint.py::test_resume_is_bit_identical[muon-zero2-tp]",
            "test_checkpoint.py::test_muon_trains_on_in_another_layout",
            "test_dpo.py::test_dpo_with_muon_over_tensor_and_zero3_equals_one_device",
            "test_grpo.py::test_the_update_in_every_layout_equals_one_device[muon-tensor4-zero3]",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "The planner's predicted state equals the compiled step's within 2%",
        (
            "test_planner.py::test_prediction_matches_the_compiled_step",
            "test_planner.py::test_planner_and_ledger_agree_on_the_minimum_and_the_state",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "The planner's ZeRO state and data-parallel traffic are the ZeRO paper's, by hand",
        ("test_planner.py::test_the_planner_predicts_the_zero_papers_bytes_on_data_8",),
    ),
    Claim(
        "docs/layouts.md",
        "jaxpar inspect's leaf bytes add up to the compiled state",
        ("test_inspect.py::test_leaf_bytes_add_up_to_the_compiled_state",),
    ),
    Claim(
        "docs/layouts.md",
        "The ring with every ZeRO stage, and buckets, equal XLA's all-reduce",
        ("test_dp.py::test_ring_with_every_zero_stage", "test_dp.py::test_bucket_packing"),
    ),
    Claim(
        "docs/layouts.md",
        "Local SGD and DiLoCo: one-step averages equal the all-reduce, the outer step is Nesterov",
        (
            "test_local_sgd.py::test_one_step_averages_of_sgd_equal_gradient_all_reduce",
            "test_local_sgd.py::test_outer_step_is_diloco_nesterov",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "Replica groups across processes equal one device within 1e-4 (ring too)",
        ("test_replica.py::test_ring_reduction_over_replicas_equals_one_device",),
    ),
    Claim(
        "docs/layouts.md",
        "ZeRO-Offload with a pipeline, and offloaded activations, train as without offload",
        (
            "test_offload.py::test_offload_with_a_pipeline",
            "test_offload.py::test_remat_offload_trains_like_keeping_activations",
        ),
    ),
    Claim(
        "docs/layouts.md",
        "A step too big for the device is refused before compiling, naming settings that fit",
        (
            "test_preflight.py::test_too_big_a_step_names_the_settings_that_fit",
            "test_preflight.py::test_state_too_big_is_refused_before_compiling",
        ),
    ),
    # docs/how-it-works.md
    Claim(
        "docs/how-it-works.md",
        "Each leaf's four shardings: Megatron and ZeRO placement, an unsplittable rule named",
        (
            "test_sharding.py::test_megatron_and_zero_placement",
            "test_sharding.py::test_rule_that_cannot_split_is_an_error_naming_leaf_and_rule",
        ),
    ),
    Claim(
        "docs/how-it-works.md",
        "The ledger reads ZeRO-1/2/3 in bf16 at 1.0 x the minimum",
        ("test_ledger.py::test_bf16_zero_moves_the_compute_dtype",),
    ),
    Claim(
        "docs/how-it-works.md",
        "The packages import one way, lowest first",
        ("test_imports.py::test_rooms_import_only_downwards",),
    ),
    Claim(
        "docs/how-it-works.md",
        "Golden partition specs and collective counts per strategy",
        ("test_golden.py::test_partition_specs", "test_golden.py::test_collective_counts"),
    ),
    Claim(
        "docs/how-it-works.md",
        "Gradient accumulation equals one big batch",
        (
            "test_equivalence.py::test_grad_accum_equals_one_big_batch",
            f"{P}::test_grad_accum_learns_the_same_on_six_layers",
        ),
    ),
    # docs/long-sequences.md
    Claim(
        "docs/long-sequences.md",
        "Causal balance evens the work, and its positions mask is the causal mask",
        (
            "test_context.py::test_balance_evens_the_causal_work",
            "test_context.py::test_the_positions_mask_is_the_causal_mask_of_the_reordered_tokens",
        ),
    ),
    Claim(
        "docs/long-sequences.md",
        "Activation memory falls as 1/context",
        ("test_context.py::test_activation_memory_falls_as_one_over_context",),
    ),
    Claim(
        "docs/long-sequences.md",
        "Sequence parallel moves what tensor parallel moves, in less memory",
        (
            "test_context.py::test_sequence_parallel_moves_what_tensor_parallel_moves_in_less_memory",
        ),
    ),
    # docs/experts.md
    Claim(
        "docs/experts.md",
        "The mixture layer's output and gradients equal a loop over the experts (with and "
        "without drops, dropless)",
        (
            "test_moe.py::test_without_drops_output_and_gradients_equal_the_loop",
            "test_moe.py::test_with_drops_equal_the_loop_given_the_same_drop_mask",
            "test_moe.py::test_dropless_grouped_products_equal_the_loop_where_capacity_would_drop",
        ),
    ),
    Claim(
        "docs/experts.md",
        "Dropless trains equal to one device in every expert degree and schedule, at the "
        "all-gather dispatcher's bytes",
        (
            "test_moe.py::test_dropless_trains_in_every_layout_as_on_one_device",
            "test_moe.py::test_dropless_moves_the_all_gather_dispatchers_bytes",
        ),
    ),
    Claim(
        "docs/experts.md",
        "The expert metrics are the whole batch's in any layout",
        ("test_moe.py::test_the_metrics_report_the_whole_batch_in_any_layout",),
    ),
    Claim(
        "docs/experts.md",
        "The drop rate falls with the capacity factor and is zero dropless",
        (
            "test_moe.py::test_the_drop_rate_falls_as_the_capacity_factor_grows_and_is_zero_dropless",
        ),
    ),
    Claim(
        "docs/experts.md",
        "Mixtral and Qwen3-MoE: first-step loss, exported logits and generate equal transformers",
        (
            "test_mixtral.py::test_first_step_loss_is_transformers_loss",
            "test_mixtral.py::test_greedy_continuations_are_transformers_generate",
        ),
    ),
    # docs/deepseek.md
    Claim(
        "docs/deepseek.md",
        "Multi-token prediction: the loss at depths 1 and 2 is DeepSeek's formula, its layers "
        "read and write back bitwise, and it trains equal to one device in every layout",
        (
            "test_mtp.py::test_the_loss_is_deepseeks_formula",
            "test_mtp.py::test_the_modules_layers_read_and_write_back_bitwise",
            "test_mtp.py::test_the_modules_train_in_every_layout_as_on_one_device",
        ),
    ),
    Claim(
        "docs/deepseek.md",
        "DeepSeek-V3 and Qwen2-MoE: first-step loss and greedy generate equal transformers'",
        (
            "test_deepseek.py::test_first_step_loss_is_transformers_loss",
            "test_deepseek.py::test_greedy_continuations_are_transformers_generate",
        ),
    ),
    Claim(
        "docs/deepseek.md",
        "deepseek-tiny trains equal to one device in every layout; context gathers the latent "
        "at the minimum",
        (
            "test_deepseek.py::test_deepseek_trains_in_every_layout_as_on_one_device",
            "test_deepseek.py::test_context_gathers_the_latent_at_the_textbook_minimum",
        ),
    ),
    Claim(
        "docs/deepseek.md",
        "The balancing bias moves by DeepSeek's rule, bit-identical on every device",
        (
            "test_deepseek.py::test_the_balancing_bias_moves_by_deepseeks_rule_on_every_device_alike",
        ),
    ),
    # docs/gemma.md
    Claim(
        "docs/gemma.md",
        "Gemma 2 and 3: first-step loss and generate past the window equal transformers'",
        (
            "test_gemma.py::test_first_step_loss_is_transformers_loss",
            "test_gemma.py::test_greedy_continuations_past_the_window_are_transformers_generate",
        ),
    ),
    Claim(
        "docs/gemma.md",
        "Gemma 3 trains equal to one device in every layout; the window's halo over context",
        (
            "test_gemma.py::test_gemma3_trains_in_every_layout_as_on_one_device",
            "test_context.py::test_a_windowed_layers_halo_is_the_direct_form",
        ),
    ),
    Claim(
        "docs/gemma.md",
        "Packed documents through Gemma's windows over context equal each document alone; "
        "soft caps are the same in every attention form",
        (
            "test_documents.py::test_packed_documents_through_gemmas_windows_over_context",
            "test_gpu.py::test_capped_scores_are_the_same_in_every_form",
        ),
    ),
    Claim(
        "docs/gemma.md",
        "LoRA on Gemma's projections loads into PEFT with jaxpar's logits",
        ("test_gemma.py::test_lora_on_gemmas_projections_loads_into_peft",),
    ),
    Claim(
        "docs/gemma.md",
        "Gemma 3's multimodal releases train as their text model from transformers' loss, "
        "decode as its generate does, export back as released (the vision tower bitwise) or "
        "as text alone, and read their sparse text configs at transformers' defaults",
        (
            "test_gemma.py::test_a_multimodal_release_trains_from_transformers_loss",
            "test_gemma.py::test_a_multimodal_release_exports_as_released_or_as_text_alone",
            "test_gemma.py::test_a_multimodal_release_decodes_as_transformers_generate",
            "test_released.py::test_a_text_config_left_out_reads_as_transformers_defaults",
        ),
    ),
    # docs/generation.md (speculative decoding)
    Claim(
        "docs/generation.md",
        "Speculative decoding with the multi-token prediction module gives plain greedy "
        "decoding's tokens, Llama and DeepSeek-tiny, 1 and 8 prompts, one device and "
        "tensor=2, and accepts exactly the drafts the module's guesses over the whole "
        "sequence predict",
        ("test_speculative.py::test_speculation_is_plain_greedy_decoding",),
    ),
    # docs/hugging-face.md
    Claim(
        "docs/hugging-face.md",
        "GPT-OSS (sinks, sliding and full attention, biased experts with the clamped SwiGLU, "
        "YaRN): first-step loss in three layouts, export and greedy decoding equal "
        "transformers'; the released MXFP4 experts refused in one line",
        (
            "test_gpt_oss.py::test_the_checkpoint_reads_as_its_traits",
            "test_gpt_oss.py::test_first_step_loss_is_transformers_loss",
            "test_gpt_oss.py::test_trained_and_exported_logits_are_transformers_logits",
            "test_gpt_oss.py::test_greedy_continuations_past_the_window_are_transformers_generate",
            "test_gpt_oss.py::test_the_released_mxfp4_experts_are_refused_in_one_line",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "Attention sinks are the same in every attention form and through a ring cache",
        (
            "test_gpu.py::test_sinks_are_the_same_in_every_form",
            "test_gpu.py::test_a_ring_cache_of_the_window_equals_the_direct_form",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "Llama trains equal to one device in every layout, tied embeddings too",
        (
            "test_llama.py::test_llama_layout_equals_one_device",
            "test_llama.py::test_tied_embeddings_equal_one_device",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "A random Llama checkpoint loads with transformers' logits in every layout, and "
        "trained and exported, loads back in transformers",
        (
            "test_hf.py::test_loaded_weights_give_transformers_logits_in_every_layout",
            "test_hf.py::test_train_export_and_load_in_transformers",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "YaRN rotary scaling (Qwen3's long context, DeepSeek-V3, GPT-OSS) is transformers': "
        "its frequencies and attention factors, a checkpoint's first-step loss in three "
        "layouts, export and generate",
        (
            "test_rope.py::test_yarn_is_transformers_frequencies_and_factors",
            "test_hf.py::test_a_yarn_checkpoint_trains_from_transformers_loss",
            "test_hf.py::test_a_yarn_checkpoint_decodes_as_transformers_generate",
            "test_hf.py::test_train_export_and_load_in_transformers",
            "test_deepseek.py::test_first_step_loss_is_transformers_loss",
            "test_deepseek.py::test_greedy_continuations_are_transformers_generate",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "jaxpar plan reads the released configs of DeepSeek-V3, Kimi K2, Qwen3-8B (YaRN) and "
        "Llama 3.1 8B and 70B, and counts their published parameters within 0.5%",
        ("test_released.py::test_plan_reads_the_release_and_counts_its_parameters",),
    ),
    Claim(
        "docs/hugging-face.md",
        "Mistral, Qwen2, Qwen3: first-step loss and greedy generate equal transformers'",
        (
            "test_families.py::test_first_step_loss_is_transformers_loss",
            "test_families.py::test_greedy_continuations_are_transformers_generate",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "An exported checkpoint reads back exactly; each process reads only its slices",
        (
            "test_hf_input.py::test_an_exported_checkpoint_reads_back_exactly",
            "test_hf_input.py::test_each_process_reads_only_its_own_devices_slices",
        ),
    ),
    Claim(
        "docs/hugging-face.md",
        "Nothing outside models/ names a model; a family is one record",
        (
            "test_registry.py::test_no_model_is_named_outside_models",
            "test_registry.py::test_a_family_is_one_record",
        ),
    ),
    # docs/adapters.md
    Claim(
        "docs/adapters.md",
        "LoRA and QLoRA train equal to one device in every layout",
        (
            "test_adapters.py::test_adapters_train_in_every_layout_as_on_one_device",
            "test_adapters.py::test_a_quantized_base_trains_as_its_dequantized_fp32_model",
        ),
    ),
    Claim(
        "docs/adapters.md",
        "LoRA equals PEFT: PEFT loads jaxpar's adapters with its logits, and trains on from PEFT's",
        (
            "test_peft.py::test_peft_loads_the_exported_adapters_with_jaxpar_s_logits",
            "test_peft.py::test_an_adapter_peft_made_trains_on_from_peft_s_loss",
        ),
    ),
    Claim(
        "docs/adapters.md",
        "Only the adapters cross the data axis; a device's base bytes are the formula's",
        (
            "test_adapters.py::test_only_the_adapters_cross_the_data_axis",
            "test_adapters.py::test_a_device_s_base_bytes_are_the_formula_s_and_the_planner_s",
        ),
    ),
    Claim(
        "docs/adapters.md",
        "A QLoRA step over tensor sends at least its minimum: the adapters' partial gradients",
        ("test_adapters.py::test_a_qlora_step_over_tensor_sends_at_least_its_minimum",),
    ),
    # docs/preference.md
    Claim(
        "docs/preference.md",
        "DPO equals TRL's DPOTrainer (gradient at step 1, loss after one step)",
        ("test_dpo.py::test_dpo_equals_trl",),
    ),
    Claim(
        "docs/preference.md",
        "DPO equals one device in every layout; a precomputed reference equals the held copy",
        (
            "test_dpo.py::test_dpo_in_every_layout_equals_one_device",
            "test_dpo.py::test_a_precomputed_reference_equals_the_held_copy",
            "test_dpo.py::test_dpo_on_adapters_in_3d_equals_one_device",
        ),
    ),
    # docs/grpo.md
    Claim(
        "docs/grpo.md",
        "GRPO's loss and gradient equal TRL's GRPOTrainer",
        (
            "test_grpo.py::test_grpo_equals_trl",
            "test_grpo.py::test_the_loss_and_its_gradient_are_the_formulas",
        ),
    ),
    Claim(
        "docs/grpo.md",
        "GRPO's update equals one device in every layout; completions are the same, the "
        "reshard at its minimum",
        (
            "test_grpo.py::test_the_update_in_every_layout_equals_one_device",
            "test_grpo.py::test_the_same_completions_in_every_layout_and_the_reshard_at_its_minimum",
        ),
    ),
    Claim(
        "docs/grpo.md",
        "GSPO equals TRL's sequence-level GRPOTrainer (step-1 gradient, step-2 loss) and one "
        "device over context and tensor",
        (
            "test_grpo.py::test_grpo_equals_trl[gspo-0.04-2-True]",
            "test_grpo.py::test_the_update_in_every_layout_equals_one_device[gspo-context2-tensor2]",
        ),
    ),
    Claim(
        "docs/grpo.md",
        "A reward model equals TRL's RewardTrainer at steps 1 and 2, and one device in 3 "
        "layouts; its export scores alike in transformers",
        (
            "test_reward.py::test_the_loss_gradient_and_accuracy_equal_trls_reward_trainer",
            "test_reward.py::test_a_reward_model_trains_in_every_layout_as_on_one_device",
            "test_reward.py::test_the_walk_through_exports_a_classifier_that_scores_as_jaxpar",
        ),
    ),
    Claim(
        "docs/grpo.md",
        "A reward model as GRPO's reward scores each completion as transformers scores TRL's "
        "rendering of it, weighted beside functions",
        ("test_reward.py::test_the_walk_through_exports_a_classifier_that_scores_as_jaxpar",),
    ),
    Claim(
        "docs/grpo.md",
        "Multi-turn episodes keep the policy's turns as sampled, never train on the tool's "
        "turns, and replay from (seed, step, prompt, sample)",
        (
            "test_grpo.py::test_episodes_keep_the_policys_turns_as_sampled_and_never_train_on_"
            "the_tools",
            "test_grpo.py::test_the_calculator_answers_calls_and_rewards_the_right_answer",
        ),
    ),
    Claim(
        "docs/grpo.md",
        "The calculator walk-through's fine-tune calls the calculator in a quarter of its "
        "conversations, each told what the shipped Calculator answers and ending on an "
        "answer it rewards; its questions' answers are their products",
        ("test_grpo.py::test_the_calculator_walk_throughs_data_is_what_the_calculator_answers",),
    ),
    Claim(
        "docs/grpo.md",
        "A GRPO run resumed between rollouts repeats its completions and weights bitwise",
        ("test_grpo.py::test_a_resumed_run_repeats_its_rollouts_and_weights_bitwise",),
    ),
    Claim(
        "docs/grpo.md",
        "Rollouts on devices of their own, up to grpo.staleness steps behind, train as the "
        "same rollouts made on the trainer's devices (bitwise), each by a policy no older than "
        "the bound, the ratio against the log-probabilities stored with them, and the weights "
        "sent at their minimum bytes",
        ("test_grpo.py::test_stale_rollouts_apart_train_by_their_samplers_log_probabilities",),
    ),
    # docs/fine-tuning.md
    Claim(
        "docs/fine-tuning.md",
        "A packed window equals each document alone (gpt, and Llama against transformers)",
        (
            "test_documents.py::test_a_packed_window_equals_each_document_alone",
            "test_documents.py::test_a_packed_llama_window_equals_transformers_on_each_document",
        ),
    ),
    Claim(
        "docs/fine-tuning.md",
        "A masked loss is the same in every layout (never a mean of means)",
        (
            "test_documents.py::test_a_masked_loss_is_the_same_in_every_layout",
            "test_documents.py::test_a_mean_of_means_would_differ_by_the_layout",
        ),
    ),
    Claim(
        "docs/fine-tuning.md",
        "A packed step lowered for CUDA hands the documents to cuDNN's kernel as its mask",
        ("test_gpu.py::test_packed_documents_reach_the_cudnn_kernel_as_its_mask",),
    ),
    Claim(
        "docs/fine-tuning.md",
        "The chat mask marks exactly the answers, as transformers' chat template renders them",
        ("test_documents.py::test_the_chat_mask_marks_exactly_the_answers",),
    ),
    Claim(
        "docs/fine-tuning.md",
        "A resume after kill -9 reads the same batches, masks and documents",
        ("test_documents.py::test_resume_after_kill_9_reads_the_same_batches_masks_and_documents",),
    ),
    # docs/generation.md
    Claim(
        "docs/generation.md",
        "Decoding through the cache gives a full forward pass's logits, in every layout",
        (
            "test_generate.py::test_decoding_through_the_cache_equals_a_full_forward_pass",
            "test_generate.py::test_greedy_and_sampled_output_is_the_same_in_every_layout",
        ),
    ),
    Claim(
        "docs/generation.md",
        "The decode loop copies no weight and no cache; the cache holds the formula's bytes",
        (
            "test_generate.py::test_the_decode_loop_copies_no_weight_and_no_cache",
            "test_generate.py::test_the_cache_holds_the_formula_per_token",
        ),
    ),
    Claim(
        "docs/generation.md",
        "Sampling at temperature 1 matches the model's distribution",
        ("test_generate.py::test_sampling_at_temperature_1_matches_the_distribution",),
    ),
    # docs/evaluation.md
    Claim(
        "docs/evaluation.md",
        "One compile a length bucket; scores equal the training forward in every family",
        (
            "test_lm_eval.py::test_one_compile_a_length_bucket_however_many_requests",
            "test_lm_eval.py::test_scores_are_the_training_forward_in_every_family",
        ),
    ),
    Claim(
        "docs/evaluation.md",
        "Held-out loss is the same under every layout",
        ("test_eval.py::test_held_out_loss_is_the_same_under_every_layout",),
    ),
    # docs/checkpoints.md
    Claim(
        "docs/checkpoints.md",
        "SIGTERM saves and exits 0; a bad checkpoint directory exits 2",
        (
            "test_checkpoint.py::test_sigterm_saves_and_exits_0",
            "test_checkpoint.py::test_corrupt_checkpoint_exits_2",
        ),
    ),
    Claim(
        "docs/checkpoints.md",
        "Arrays are saved uncompressed unless checkpoint.compress asks; a run resumes from "
        "either kind",
        (
            "test_checkpoint.py::test_arrays_are_saved_uncompressed_unless_asked_and_either_restores",
        ),
    ),
    Claim(
        "docs/checkpoints.md",
        "At checkpoint.every=1 the step does not donate its state, and a save hands orbax the "
        "state's own arrays, with no copy; otherwise the step donates and a save copies",
        (
            "test_checkpoint.py::test_saving_every_step_hands_orbax_the_state_itself_and_the_step_keeps_it",
        ),
    ),
    Claim(
        "docs/checkpoints.md",
        "A loss spike skipped or rolled back leaves a run equal to one that never read the "
        "batches it dropped, in every layout; the window resumes with the state",
        (
            "test_spikes.py::test_the_limit_is_the_windows_mean_and_deviations_once_half_full",
            "test_spikes.py::test_a_skipped_spike_leaves_the_run_a_run_without_its_batch",
            "test_spikes.py::test_rollback_returns_to_the_checkpoint_and_skips_the_batches_since",
            "test_spikes.py::test_a_spike_in_pipeline_tensor_and_data_rolls_back_as_a_run_"
            "without_its_batches",
            "test_spikes.py::test_the_window_resumes_with_the_state_and_runs_switch_watching",
            "test_spikes.py::test_rollback_without_checkpoints_and_under_grpo_is_refused",
        ),
    ),
    # docs/many-hosts.md
    Claim(
        "docs/many-hosts.md",
        "Checkpoints move between two processes and one; a lost worker is named",
        (
            "test_distributed.py::test_checkpoints_move_between_two_processes_and_one",
            "test_distributed.py::test_a_dead_worker_is_named_with_its_signal_and_the_checkpoint",
        ),
    ),
    Claim(
        "docs/many-hosts.md",
        "A lost worker restarts the run on the processes left, as a straight run in that "
        "layout from the same checkpoint; a hung one is named and restarted",
        (
            "test_elastic.py::test_a_lost_worker_restarts_on_those_left_as_a_straight_run_would",
            "test_elastic.py::test_a_hung_worker_is_named_and_restarted_and_a_second_death_gives_up",
            "test_elastic.py::test_data_shrinks_first_and_accumulation_keeps_the_batch",
            "test_elastic.py::test_the_slurm_script_retries_a_failed_step_but_not_bad_input",
        ),
    ),
    # docs/data.md
    Claim(
        "docs/data.md",
        "An epoch visits every window once, whichever process builds which rows",
        (
            "test_mixture.py::test_the_order_is_a_bijection_of_seed_and_epoch",
            "test_mixture.py::test_an_epoch_visits_every_window_once",
            "test_mixture.py::test_two_processes_read_each_window_once_an_epoch",
        ),
    ),
    Claim(
        "docs/data.md",
        "A mixture's blocks hold each source's exact share, and a phase switches at its step",
        ("test_mixture.py::test_blocks_hold_exact_shares_and_a_phase_switches_at_its_step",),
    ),
    Claim(
        "docs/data.md",
        "A resume reads the straight run's batches bitwise; a changed mixture goes on from "
        "the recorded position and says what changed",
        (
            "test_mixture.py::test_kill_9_mid_phase_resumes_to_the_straight_runs_batches",
            "test_mixture.py::test_a_changed_mixture_goes_on_from_the_recorded_position",
        ),
    ),
    Claim(
        "docs/data.md",
        "A bad mixture file is refused in one line naming the key and the fix",
        (
            "test_mixture.py::test_bad_mixture_files_are_refused_in_one_line",
            "test_mixture.py::test_sources_with_different_vocabularies_are_refused",
        ),
    ),
    Claim(
        "docs/data.md",
        "`prepare-data --workers 1` and `--workers 2` write byte-identical folders",
        ("test_tokens.py::test_workers_1_and_2_write_byte_identical_folders",),
    ),
    Claim(
        "docs/data.md",
        "A `datasets` folder (`save_to_disk`, two Arrow shards) prepares to the bytes of its "
        "documents as JSONL; a DatasetDict, or a folder without `text`, exits 2",
        ("test_tokens.py::test_a_datasets_folder_reads_as_its_jsonl",),
    ),
    # docs/your-model.md
    Claim(
        "docs/your-model.md",
        "Your own Flax module or pytree loss trains equal to one device in every strategy",
        (
            "test_api.py::test_user_nnx_module_every_strategy_equals_one_device",
            "test_api.py::test_plain_pytree_with_regex_rules",
            "test_your_model_page.py::test_your_own_model_examples_run",
        ),
    ),
    Claim(
        "docs/your-model.md",
        "A registered model trains, inspects and plans from its record alone",
        ("test_registry.py::test_a_registered_model_trains_inspects_and_plans",),
    ),
    Claim(
        "docs/your-model.md",
        "A shipped model is built from Python as the command builds it (`jaxpar.setup`)",
        ("test_your_model_page.py::test_your_own_model_examples_run",),
    ),
    Claim(
        "docs/your-model.md",
        "A hook runs around the steps; its figures are logged, its failure ends the run named",
        ("test_api.py::test_a_hook_runs_around_the_steps_and_fails_a_run_in_one_line",),
    ),
    Claim(
        "docs/how-it-works.md",
        "The last release's module paths import, warning with each one's new home",
        (
            "test_imports.py::test_the_last_releases_module_paths_import_with_a_warning",
            "test_imports.py::test_an_old_name_says_where_it_lives_and_an_unknown_path_still_fails",
        ),
    ),
    # docs/benchmarks.md
    Claim(
        "docs/benchmarks.md",
        "Compile time does not grow with depth; the bench's tables are the docs'",
        (
            "test_bench.py::test_compile_time_does_not_grow_with_depth",
            "test_docs.py::test_the_measured_tables_are_the_benchs",
        ),
    ),
    Claim(
        "docs/benchmarks.md",
        "The same GPT in PyTorch is compared side by side",
        ("test_scripts.py::test_compare_torch_prints_the_table_with_the_load",),
    ),
    # docs/gpus.md
    Claim(
        "docs/gpus.md",
        "A CUDA step (lowered here) runs cuDNN attention or blocked attention, no SxS buffer",
        (
            "test_gpu.py::test_a_cuda_bf16_step_runs_cudnn_attention_with_no_sxs_buffer",
            "test_gpu.py::test_a_cuda_fp32_step_runs_blocked_attention_with_no_sxs_buffer",
            "test_gpu.py::test_blocked_attention_equals_the_direct_form",
        ),
    ),
    Claim(
        "docs/gpus.md",
        "The planner's FLOPs per token are the hand count; MFU uses the device's peak",
        (
            "test_observe.py::test_flops_per_token_is_the_hand_count",
            "test_observe.py::test_peak_table_by_device_kind",
        ),
    ),
)
