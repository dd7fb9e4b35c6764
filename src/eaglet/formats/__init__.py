"""What eaglet keeps on disk, read without torch: file names, manifests and their checks, the draft's config and
the aux layer-id convention. Every stage, preflight and the pipeline read their inputs through here."""
