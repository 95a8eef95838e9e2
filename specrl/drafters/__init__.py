"""specrl.drafters"""
