"""Lightning callbacks: progress lines, checkpoint metadata, and (with their issues) inference-only methods."""
