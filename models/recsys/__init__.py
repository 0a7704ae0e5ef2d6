"""The Semantic-ID recommender: the backbone, its draft heads, its token trees and item scores."""
