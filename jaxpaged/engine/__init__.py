"""The engine loop: schedule -> run the step on the device -> update sequences and outputs.

``llm_engine.LLMEngine`` (the loop), ``scheduler`` (which sequences run this step),
``step_inputs`` (a step's arrays: one field table to build, pack and unpack), ``model_runner`` (the
jitted step), ``readback`` (sampled tokens to the host), ``metrics``. The sequences they move are
``jaxpaged.request``'s.
"""
