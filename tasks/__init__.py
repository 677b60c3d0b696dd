"""Pipeline stages: one thin module per stage."""
