"""The commit protocol: how a staged checkpoint becomes visible, is replaced or removed,
and what a crashed save leaves behind ([SP-COMMIT-*])."""
