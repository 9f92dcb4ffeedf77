"""Engine: what drives vLLM — the engine configuration, the in-process engine, the runners (offline,
server, URL), the ``vllm serve`` process and its guard, model directories and the doctor.
"""
