"""Model building blocks: RMSNorm, rotary position embedding, paged attention."""
