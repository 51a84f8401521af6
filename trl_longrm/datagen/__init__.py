"""The method's data from a user's own corpus (LongRM sections 4.2, 4.3, 6.2): long prompts from short records,
sampled responses, judges' judgments, consensus voting into SFT / SimPO / DisRM rows, mixing, and best-of-N
self-distillation. Each step reads and writes JSONL, resumes record by record, and runs as `trl-longrm data <step>`.
"""
