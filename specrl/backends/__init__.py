"""specrl.backends"""
