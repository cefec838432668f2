"""The engine core: token ids in and out on one thread (scheduler, step, engine), and the text
and the models around it (service, models)."""
