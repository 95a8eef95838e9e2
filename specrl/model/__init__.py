"""specrl.model"""
