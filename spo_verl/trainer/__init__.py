"""Thin adapters that let verl's trainers feed SPO metadata to the estimators and run SPO's actor loss."""
