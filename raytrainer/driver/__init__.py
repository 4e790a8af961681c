"""Driver side: runs in the user's process; launches Ray Train and shows what the workers report."""
