from accelopt_plugins.gpu_kernels import PLUGIN
def test_run(run_tiny, tmp_path):
    rec = run_tiny(PLUGIN, overrides=["plugins.gpu_kernels.prune_amount=0.5", "plugins.gpu_kernels.conv_autotune=true",
        f"plugins.gpu_kernels.conv_cache={tmp_path}/c.json", "plugins.gpu_kernels.channels_last=auto", "plugins.gpu_kernels.tiled_linear=tiled"])
    for r in rec.plugin_rows: print(r)
    for j in rec.jobs: print(j)
    assert 0
