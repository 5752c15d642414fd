"""Typed IPC messages (`messages`), their one codec (`codec`) and the socket plumbing (`ipc`)."""
