"""Developer tools that are not part of the engine package: SASS / spill inspection, the cost-model fit, the
megakernel variant runner, and training the small model (tools/README.md)."""
