"""The integration tests CI runs (``scripts/test.sh``): each guarantee and each path once, on one host.

Every other integration test is a second variant of what these cover (another host, strategy, ZeRO stage,
worker count or node count) or a path CI reaches another way, and runs in the full tier
(``scripts/test.sh --full``, every test). conftest.py marks the tests not listed here ``full``;
tests/unit/test_ci_tier.py fails when a listed id no longer collects, so the list cannot go stale silently.

Why a list and not a mark per test: it is the one place that says what CI proves, and what it costs. The 24
tests of the CI check of 2026-12-02 (the one-loop test came after) took about 17 minutes, beside a CPU-bound
process on this 2-core machine (each starts a cold group of 2 workers, ~25 s, at least once); the CI tier as a
whole 29 minutes there. Left to the full tier for time, with what CI runs in their place: ZeRO-3 sharding
under TRL (185 s; FSDP sharding: test_fsdp.py, LoRA under FSDP), two nodes (145 s; the elastic, preemption and
submit tests start clusters too, all full tier), the preemption notice and the lost worker (89 s, 98 s; the
SIGTERM test saves, commits, restarts and ends bitwise), TRL's dpo.py (77 s; sft.py).
"""

from __future__ import annotations

CI_TESTS = {
    # raytrainer's own Trainer on DDP: one process's numbers on 2 workers, the README's demo, bad input
    "test_ddp.py::test_two_workers_batch_8_match_one_process_batch_16",
    "test_ddp.py::test_demo_reaches_90_percent_on_two_workers",
    "test_ddp.py::test_bad_input_fails_on_the_driver_before_any_worker",
    # FSDP on CPU workers: real shards, an exact resume; per-shard construction of a transformers model
    "test_fsdp.py::test_fsdp_shards_trains_and_resumes_exactly",
    "test_fsdp.py::test_fsdp_model_init_initialises_each_rank_shard_of_a_transformers_model",
    # each guarantee on one hosted trainer (TRL's SFTTrainer or on_ray(transformers.Trainer): one path)
    "test_guarantees.py::test_a_flag_set_on_one_rank_is_every_ranks[trl]",
    "test_guarantees.py::test_a_resume_verifies_the_checkpoint_and_falls_back_past_a_damaged_one[transformers]",
    "test_guarantees.py::test_a_save_does_not_block_the_step_and_a_failed_write_fails_the_run_naming_it"
    "[transformers-fsdp]",
    "test_guarantees.py::test_evaluation_is_gathered_on_rank_zero_and_equals_one_process[transformers]",
    "test_guarantees.py::test_a_checkpoint_of_two_workers_resumes_on_one_along_the_uninterrupted_curve[trl]",
    "test_guarantees.py::test_a_sigterm_to_a_workers_process_saves_commits_and_the_restart_ends_bitwise[trl]",
    "test_guarantees.py::test_a_collected_trainers_workers_serve_the_next_trainer_of_its_shape[transformers]",
    "test_guarantees.py::test_a_resume_from_a_bucket_reads_each_ranks_share[trl]",
    "test_guarantees.py::test_lora_under_a_sharded_strategy_checkpoints_the_adapter_only_and_resumes_bitwise"
    "[transformers-fsdp]",
    # TRL's own scripts with only the imports changed; a user's Trainer subclass; LoRA under FSDP
    "test_hosted.py::test_a_trl_script_on_two_workers_trains_as_in_one_process_and_resumes[sft]",
    "test_hosted.py::test_trl_sft_script_with_a_worker_killed_mid_run_ends_with_the_uninterrupted_weights",
    "test_hosted.py::test_a_trl_script_sharded_on_two_cpu_workers_trains_and_saves[sft-peft-fsdp]",
    "test_hosted.py::test_grpo_with_a_vllm_server_is_refused_on_the_driver",
    "test_hosted.py::test_a_users_compute_loss_subclass_on_two_workers_matches_one_process",
    # a subclass of a twin (class Mine(raytrainer.on_ray(...))): its constructor and overrides on the ranks
    "test_hosted.py::test_a_subclass_of_a_twin_runs_its_constructor_and_overrides_on_the_workers",
    # raytrainer's Trainer on transformers' loop (raytrainer.one_loop): built by each rank, flags agreed
    "test_one_loop_on_workers.py::test_one_loop_trainer_on_two_workers_agrees_a_stop_of_one_rank_and_commits",
    # a PBT exploit's hyperparameters on the ranks of transformers' loop
    "test_one_loop_on_workers.py::test_a_pbt_exploit_on_two_workers_takes_the_trial_s_hyperparameters",
    # nonfinite_loss="error" in transformers' loop on the workers: stops before the update, not retried
    "test_failures.py::test_a_nonfinite_loss_on_one_rank_stops_the_run_and_is_not_retried[transformers]",
    # the loss on 2 workers is one process's, for a model whose loss is a mean
    "test_loss_scale.py::test_two_workers_log_one_process_loss_grad_norm_and_eval_loss[gpt2-lm-hosted]",
    # the console: only raytrainer's lines through a save, an evaluation, a resume and a worker's failure
    "test_failures.py::test_a_run_that_saves_evaluates_resumes_and_fails_on_a_worker_shows_only_raytrainer_s_lines",
    # raytrainer's Trainer keeps its trained model across calls, on its group and on a new one after close()
    "test_warm_workers.py::test_one_group_serves_train_evaluate_predict_and_close_leaves_nothing",
    # evaluate() then train() on 2 workers: one shuffle on every rank, the model in DDP, one process's weights
    "test_warm_workers.py::test_a_trainer_evaluated_before_train_trains_as_one_process",
    # hyperparameter_search: Optuna, 2 workers per trial, a pruned trial
    "test_search.py::test_optuna_two_workers_per_trial_prunes_planted_bad_trial",
    # Ray Tune with num_workers=0: each trial's trainer copied into its actor and trained there
    "test_search.py::test_ray_tune_with_num_workers_0_trains_each_trial_in_its_own_actor",
    # resources no node has: refused at once, once Ray is up
    "test_resources.py::test_use_gpu_on_a_cluster_without_gpus_is_refused_at_once_once_ray_is_up",
    "test_resources.py::test_a_resource_no_node_has_is_refused_at_once",
}
