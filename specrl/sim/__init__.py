"""specrl.sim"""
