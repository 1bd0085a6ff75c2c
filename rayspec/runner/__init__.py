"""The model runner: static-shape decoder steps, their CUDA graphs and the attention backend of decode steps, kept
apart from the model code (as vLLM's GPU model runner owns its CUDA graphs): a model asks its attached
:class:`~rayspec.runner.static_step.StaticSteps` for a step."""
