//! Teacher trajectories: readers for OpenThoughts3 rows (JSONL, Parquet), grouping answers by question,
//! labelling them with the reward module, and tokenised shards for the trainer.
