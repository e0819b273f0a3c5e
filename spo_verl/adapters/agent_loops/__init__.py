"""SPO's rollouts as verl agent loops (registered under the same names as the estimators)."""
