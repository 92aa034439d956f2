"""The SSD tier: persistent, self-describing segments of blocks (format), where they live (device), how they are
written (writer) and read (reader), which blocks are where (index), what survives a restart (recovery), and the disk
engine over them (tier: DiskTier, and the Tier interface; null: NullTier, the tier of an engine without SSD)."""
