"""The persistent cooperative megakernel that executes an assembled program; its device functions are the
ones the discrete kernels use (``discrete/kernels``)."""
