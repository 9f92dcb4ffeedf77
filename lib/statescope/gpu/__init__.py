"""GPU: questions only an accelerator answers — the copy-kernel race probe, kernel agreement with the
CPU kernels, the build decision and the end-to-end arms on the device.
"""
