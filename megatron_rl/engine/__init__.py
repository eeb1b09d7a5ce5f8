"""The Megatron engine: model chunks, optimizer and schedule of one model on this rank."""
