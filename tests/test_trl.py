"""A real TRL GRPO run on the CPU with this engine as its colocated vLLM: the completions TRL scores and
trains on come from the engine, and the engine holds the policy's weights after every step."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


def test_grpo_trains_on_engine_completions_and_syncs_each_step(qwen3_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig
    from weights_helpers import assert_weights_equal

    from integrations.trl import RolloutGRPOTrainer, uninstall
    from rollout.compat.vllm import LLM

    policy = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    steps = 3
    config = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=steps,
        learning_rate=5e-2,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    generated: list[list[int]] = []  # every completion the engine produced
    scored: list[list[int]] = []  # every completion TRL's reward function saw
    synced_at: list[int] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        scored.extend(list(ids) for ids in completion_ids)
        return [float(sum(t % 2 for t in ids)) for ids in completion_ids]  # prefers odd token ids

    class CheckAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            assert_weights_equal(trainer.vllm_generation.llm.engine, trainer.model)
            synced_at.append(state.global_step)

    data = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "1+1="] * 4})
    try:
        trainer = RolloutGRPOTrainer(
            model=policy,
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            llm_options={"device": "cpu", "block_size": 4},
        )
        llm = trainer.vllm_generation.llm
        assert isinstance(llm, LLM)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        real_generate = llm.generate

        def recording_generate(*args, **kwargs):
            assert_weights_equal(llm.engine, trainer.model)  # the policy was pushed before generating
            outs = real_generate(*args, **kwargs)
            generated.extend(c.token_ids for o in outs for c in o.outputs)
            return outs

        llm.generate = recording_generate
        trainer.add_callback(CheckAfterStep())
        trainer.train()
    finally:
        uninstall()
    assert synced_at == list(range(1, steps + 1))
    assert scored and len(scored) == len(generated) == steps * 4
    assert scored == generated
    changed = [n for n, p in trainer.model.named_parameters() if not p.detach().equal(before[n])]
    assert changed, "the policy did not train"
    assert llm.engine.weight_version > 0
