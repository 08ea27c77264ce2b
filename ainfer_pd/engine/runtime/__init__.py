"""Running the model on a device: streams, the runner, CUDA graphs, replica and parallel hooks."""
