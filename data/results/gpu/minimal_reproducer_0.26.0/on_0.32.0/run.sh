. <device-tmp>/vllm-0.32.0/env.sh; export PYTHONPATH=<checkout>/lib:$PYTHONPATH STATESCOPE_GPU_MEMORY_UTILIZATION=0.04 PYTHONUNBUFFERED=1 VLLM_LOGGING_LEVEL=WARNING
cd <checkout>
T=<checkout>/.gk-resume/shrink/minimal.jsonl; R=<device-tmp>/ss/0.32.0/patch/runs
c="reproduce --model tiny-gui --trace $T --control no_async --trigger-set model_runner=v1 --control-set model_runner=v1 --runs $R"
echo "statescope $c --run-id v1 --json" >> <device-tmp>/ss/commands.txt
timeout 500 python3 -m statescope.cli.main $c --run-id v1 --json > <device-tmp>/ss/0.32.0/patch/v1.json 2> <device-tmp>/ss/0.32.0/patch/v1.err; echo "rc=$?" >> <device-tmp>/ss/0.32.0/patch/v1.err
echo "statescope $c --trigger-patch accept_sync --control-run $R/v1 --run-id v1_accept_sync --json" >> <device-tmp>/ss/commands.txt
timeout 400 python3 -m statescope.cli.main $c --trigger-patch accept_sync --control-run $R/v1 --run-id v1_accept_sync --json > <device-tmp>/ss/0.32.0/patch/sync.json 2> <device-tmp>/ss/0.32.0/patch/sync.err; echo "rc=$?" >> <device-tmp>/ss/0.32.0/patch/sync.err
