"""The training stages a recipe names (`stage: sft | simpo_grm | simpo_disrm`): their trainer and config classes, the
model head each trains, and the PEFT config a stage builds from TRL's `ModelConfig`. Below both the launcher
(`trl_longrm.train`) and the memory plan (`trl_longrm.memory_plan`), which build the same trainers."""

from __future__ import annotations


# stage -> (trainer class name, config class name, model head)
STAGES = {
    "sft": ("LongSFTTrainer", "LongSFTConfig", "causal-lm"),
    "simpo_grm": ("SimPOGRMTrainer", "SimPOGRMConfig", "causal-lm"),
    "simpo_disrm": ("SimPODisRMTrainer", "SimPODisRMConfig", "seq-cls"),
}


def stage_classes(stage: str):
    """`(trainer class, config class, model head)` of `stage`."""
    import trl_longrm

    trainer_name, config_name, head = STAGES[stage]
    return getattr(trl_longrm, trainer_name), getattr(trl_longrm, config_name), head


def peft_config_for(stage: str, model_args):
    """The PEFT config of TRL's `ModelConfig` for `stage` (None without `use_peft`)."""
    from trl import get_peft_config

    if STAGES[stage][2] == "seq-cls" and model_args.use_peft:
        # The score head is new: it must always train. PEFT's SEQ_CLS task adds it (and `classifier`) to
        # `modules_to_save` itself; named in the list too, it was listed twice in the saved adapter_config.json.
        model_args.lora_task_type = "SEQ_CLS"
        modules = [m for m in model_args.lora_modules_to_save or [] if m not in ("score", "classifier")]
        model_args.lora_modules_to_save = modules or None
    return get_peft_config(model_args)
