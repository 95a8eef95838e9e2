"""specrl.rl"""
