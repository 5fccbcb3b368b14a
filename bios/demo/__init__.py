"""`bios demo`: the main job, fine-tuning on the embedded cluster."""
