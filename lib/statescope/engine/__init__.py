"""Engine: what drives vLLM — the engine configuration, the in-process engine, the runners (offline,
server, URL), the ``vllm serve`` process and its guard, model directories and the doctor.
"""
from statescope.wings import public_face

__getattr__, __dir__, __all__ = public_face(__name__, {
    "EngineConfig": "config", "default_model": "config", "model_path": "config",
    "run_doctor": "doctor", "check_model_dir": "modeldir", "OfflineEngine": "offline",
    "RequestRecord": "offline", "import_vllm": "offline", "OfflineRunner": "runners",
    "Runner": "runners", "ServerRunner": "runners", "StepRequest": "runners",
    "run_waves": "runners", "ServerStartError": "server", "VllmServer": "server",
})
