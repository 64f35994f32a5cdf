"""From ``TrainSettings`` to a trainer: which setting goes to which strategy's config, the
checks that fail at start-up, and the factory that builds the trainer."""
