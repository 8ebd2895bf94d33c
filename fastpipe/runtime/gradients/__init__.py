"""What happens to gradients at the end of a step: data-parallel averages, tied-weight sums,
token-mean counts, the whole model's norm, and the closing report every process agrees on."""
